"""Training at world size N > 1: a resident group of DeepSpeed ranks (driver, launcher, channel, rank)."""
