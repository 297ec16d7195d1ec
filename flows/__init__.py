"""Prefect flows: the ScalingInter-RL pipeline and its stage subflow."""
