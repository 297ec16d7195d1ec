"""Prefect tasks: thin, typed wrappers over ``agentgym`` library functions."""
