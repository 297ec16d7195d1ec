"""The configuration of the relative judge (``reward.judge``; agentgym.rewards.judge).

Kept apart from agentgym/config.py so the judge can be built and tested on its own;
``RewardConfig`` is the section ``PipelineConfig.reward`` holds. Same rules as the models in
agentgym/config.py: every field has a default or is required, every field has a description,
unknown fields are rejected, and cross-field checks name the field and the fix.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from agentgym.config_base import _Strict


#: RULER's default grading standards (OpenPipe ART, ``art.rewards.ruler``), in our words
DEFAULT_RUBRIC = (
    "- An episode that achieves the task's goal must always score clearly higher than one that does not.\n"
    "- Among episodes that achieve the goal, a more efficient one (fewer wasted or invalid actions, no "
    "detours) scores higher.\n"
    "- If one episode is only slightly better than another, their scores differ only slightly; if it is "
    "much better, they differ a lot.\n"
    "- Give partial credit to an episode that makes real progress towards the goal without reaching it."
)


class JudgeConfig(_Strict):
    """An LLM judge that scores the episodes of a group (one task, ``rollout.group_size`` tries)
    relative to each other, as OpenPipe ART's RULER does; the reward the estimator compares is
    ``alpha x environment reward + (1 - alpha) x judge score``. A judge that cannot answer is an
    infrastructure error (the iteration's advantages step fails and a resume asks again), never a
    reward of 0."""

    base_url: str = Field(
        ..., description="The OpenAI-compatible endpoint's base URL, as the openai client takes it "
        "(requests go to {base_url}/chat/completions): e.g. http://127.0.0.1:8000/v1 for `vllm serve` "
        "(this project's own server included), https://api.openai.com/v1.")
    model: str = Field(..., description="The judge model's name as the endpoint serves it.")
    api_key_env: str | None = Field(
        None, description="The name of the environment variable that holds the API key (sent as "
        "'Authorization: Bearer ...'); the key itself never goes in a config. None: no key (a local "
        "vLLM server).")
    alpha: float = Field(
        0.5, ge=0.0, le=1.0,
        description="The environment's share of the combined reward: alpha x environment + (1 - alpha) x "
        "judge. 0: the judge alone. Stored episode rewards stay the environment's; only what the "
        "estimator compares changes.")
    rubric: str = Field(
        DEFAULT_RUBRIC, min_length=1,
        description="The grading standards shown to the judge (default: RULER's generic rubric).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the judge (0: greedy).")
    max_tokens: int = Field(1024, ge=16, description="The judge's answer budget in tokens.")
    json_mode: bool = Field(
        True, description="Ask for a JSON answer with response_format {type: json_object} (vLLM and "
        "OpenAI honour it); false for endpoints that reject the field.")
    timeout_s: float = Field(120.0, gt=0, description="Per request, in seconds.")
    max_retries: int = Field(
        2, ge=0, description="More tries after a failed request (connection refused, timeout, HTTP 429 "
        "or 5xx) or a malformed answer (not JSON, ids that do not match, a score outside [0, 1]); "
        "when they are spent the judge raises an infrastructure error. Other 4xx answers (bad key, "
        "unknown model) are not retried.")
    retry_backoff_s: float = Field(
        1.0, ge=0.0, description="Wait before the k-th retry: retry_backoff_s x 2^(k-1), at most 30 s.")
    max_chars_per_episode: int = Field(
        6000, ge=200, description="Each episode's transcript (actions, observations, outcome) is cut "
        "to this many characters, keeping its start and its end.")
    max_task_chars: int = Field(
        2000, ge=100, description="The task (the episodes' shared first observation) is cut to this many "
        "characters.")
    show_env_reward: bool = Field(
        True, description="Show each episode's environment reward and success in its outcome line "
        "(false: the judge sees only what happened).")
    max_concurrency: int = Field(4, ge=1, description="Groups judged at once (one request each).")
    seed: int = Field(
        0, description="Salt of the shuffle: each group is shown in an order drawn from (seed, global "
        "step, group id), so a re-run shows it in the same order.")

    @model_validator(mode="after")
    def _check(self) -> "JudgeConfig":
        url = self.base_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.judge.base_url={self.base_url!r} is not an http(s) URL; set it "
                             "like http://127.0.0.1:8000/v1")
        for route in ("/chat/completions", "/completions"):
            if url.endswith(route):
                raise ValueError(f"reward.judge.base_url={self.base_url!r} names a route; set it to the base "
                                 f"the routes hang off, {url[: -len(route)]}")
        if self.alpha == 1.0:
            raise ValueError("reward.judge.alpha=1 gives the judge no weight (alpha is the environment's "
                             "share) while every group still costs a request; lower alpha (e.g. 0.5) or "
                             "remove reward.judge")
        if self.api_key_env is not None and not self.api_key_env.strip():
            raise ValueError("reward.judge.api_key_env is empty; name an environment variable (e.g. "
                             "OPENAI_API_KEY) or set it to null for a server without a key")
        return self


class RewardConfig(_Strict):
    """Rewards beyond the environment's (``PipelineConfig.reward``)."""

    judge: JudgeConfig | None = Field(
        None, description="An LLM judge scoring each group of episodes relative to each other (RULER); "
        "None: the environment's reward alone. Fields: see agentgym.rewards.judge_config.JudgeConfig.")
