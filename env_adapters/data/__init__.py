"""Data shipped with the environment adapters, and the scripts that build it."""
