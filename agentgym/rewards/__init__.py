"""Rewards beyond the environment's own: an LLM judge that scores a group of episodes relative
to each other (``judge.py``, configured by ``judge_config.JudgeConfig`` as ``reward.judge``)."""
