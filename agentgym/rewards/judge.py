"""A relative LLM judge: the episodes of one group scored against each other (``reward.judge``).

As OpenPipe ART's RULER does, the judge sees every episode of a group (one task, played
``rollout.group_size`` times from the same state) at once and gives each a score in [0, 1];
relative scores are what GRPO / RLOO compare anyway. The estimator then compares

    alpha x environment reward + (1 - alpha) x judge score          (``JudgeConfig.alpha``)

while the store keeps the environment's rewards as played.

* **Any OpenAI-compatible endpoint** (``POST {base_url}/chat/completions``: vLLM, this project's
  own ``vllm serve`` included, or a hosted API; the key is read from the environment variable
  ``api_key_env`` names), temperature 0 by default, ``timeout_s`` per request.
* **The prompt**: the task (the episodes' shared first observation) once, then each episode's
  transcript (its actions, the observations between them, how it ended), each cut to
  ``max_chars_per_episode`` keeping its start and end. Episodes are labelled 1..n in an order
  shuffled by ``random.Random`` seeded from (``seed``, global step, group id), so a re-run
  shows the same order and the judge cannot learn the episode index from its position.
* **The answer** is parsed strictly: one JSON object ``{"scores": [{"id", "explanation",
  "score"}, ...]}`` (a single ```json fence around it is tolerated), each label exactly once,
  each score a finite number in [0, 1]. A malformed answer is retried with the reason appended
  to the conversation; scores are mapped back from labels to episode ids.
* **Failures are infrastructure errors**: connection refused, timeout, HTTP 429 / 5xx and
  malformed answers are retried ``max_retries`` times, then :class:`JudgeError` (an
  ``env_adapters.base.InfraError``) is raised; another 4xx (bad key, unknown model) raises it
  at once. A failing judge never becomes a reward of 0.
* **Cached per group**: ``{store}/{run_id}/_judge/{stage}-{iteration}/{group_id}.json``,
  written atomically (a temp file renamed over it; one PUT on object stores), holding the
  request's digest (model, sampling fields, messages). A resumed run whose group shows the same
  episodes finds the digest and asks nothing; a group whose episodes changed (the iteration
  was retracted and rolled out again) has another digest and is asked again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from agentgym.rewards.judge_config import JudgeConfig
from agentgym.types import Episode, Turn
from env_adapters.base import InfraError

if TYPE_CHECKING:
    from agentgym.store.trajectory_store import TrajectoryStore

log = logging.getLogger(__name__)

#: bump when the prompt's wording or layout changes (it is part of every cache digest)
PROMPT_VERSION = 1
#: the cache folder under a run's store folder
CACHE_DIR = "_judge"

_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*)\n```\Z", re.S)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class JudgeError(InfraError):
    """The judge could not score a group (no answer, or no valid one after the retries): an
    infrastructure error, never a reward of 0."""


class MalformedAnswer(ValueError):
    """The judge answered, but not with one valid score per episode label."""


def combine(alpha: float, env_reward: float, judge_score: float) -> float:
    """The reward the estimator compares: ``alpha x env_reward + (1 - alpha) x judge_score``."""
    return alpha * env_reward + (1.0 - alpha) * judge_score


def cut_middle(text: str, budget: int) -> str:
    """``text`` if it fits in ``budget`` characters; else its start (2/5) and end (3/5) around a
    marker saying how much was cut, ``budget`` characters at most in all."""
    if len(text) <= budget:
        return text
    keep = max(budget - len(f"\n[... {len(text)} characters cut ...]\n"), 0)
    head = keep * 2 // 5
    tail = keep - head
    return text[:head] + f"\n[... {len(text) - head - tail} characters cut ...]\n" + (text[-tail:] if tail else "")


def _turn_label(k: int, turn: Turn) -> str:
    flag = " [format error]" if turn.format_error else " [invalid action]" if turn.invalid_action else ""
    return f"Action {k + 1}{flag}:"


def transcript(episode: Episode, cfg: JudgeConfig) -> str:
    """What the judge sees of one episode: each action, the observation that followed it (the
    next turn's), and an outcome line that is never cut."""
    lines: list[str] = []
    for k, turn in enumerate(episode.turns):
        if k > 0:
            lines.append(f"Observation: {turn.observation.strip()}")
        lines.append(f"{_turn_label(k, turn)} {turn.action_text.strip()}")
    how = ("the task ended" if episode.terminated else
           "stopped at the turn limit" if episode.truncated else "stopped")
    outcome = f"Outcome: {how} after {episode.num_turns} turn{'s' if episode.num_turns != 1 else ''}"
    if cfg.show_env_reward:
        outcome += f"; environment reward {episode.reward:.3g}, success: {'yes' if episode.success else 'no'}"
    body = cut_middle("\n".join(lines), max(cfg.max_chars_per_episode - len(outcome) - 1, 0))
    return f"{body}\n{outcome}" if body else outcome


def shuffle_order(episode_ids: Iterable[str], group_id: str, global_step: int, seed: int) -> list[str]:
    """The episode ids in the order the judge sees them: sorted, then shuffled by a generator
    seeded from (``seed``, ``global_step``, ``group_id``) -- the same order on every run."""
    ids = sorted(episode_ids)
    key = hashlib.sha256(f"{seed}:{global_step}:{group_id}".encode()).digest()
    random.Random(int.from_bytes(key[:8], "big")).shuffle(ids)
    return ids


@dataclass(frozen=True)
class JudgeRequest:
    """One group's question to the judge. Label ``str(k + 1)`` is episode ``order[k]``."""

    group_id: str
    order: list[str]
    messages: list[dict[str, str]]
    digest: str

    @property
    def labels(self) -> list[str]:
        return [str(k + 1) for k in range(len(self.order))]


def build_request(cfg: JudgeConfig, group_id: str, episodes: Sequence[Episode], global_step: int) -> JudgeRequest:
    """The messages for one group's episodes (shuffled, :func:`shuffle_order`) and their digest."""
    by_id = {e.episode_id: e for e in episodes}
    if len(by_id) != len(episodes):
        raise ValueError(f"group {group_id}: an episode id appears twice")
    order = shuffle_order(by_id, group_id, global_step, cfg.seed)
    first = by_id[sorted(by_id)[0]]
    task = first.turns[0].observation.strip() if first.turns else ""
    labels = [str(k + 1) for k in range(len(order))]
    system = (
        "You are judging an AI agent. Every episode below is an attempt at the same task, started "
        "from the same state. Consider each of them and give each a score between 0 and 1; the "
        "scores are compared with each other, so grade the episodes relative to one another.\n\n"
        f"Grading standards:\n{cfg.rubric.strip()}\n\n"
        "Answer with only a JSON object, no other text:\n"
        '{"scores": [{"id": "<episode id>", "explanation": "<one short sentence>", "score": <a number from 0 to 1>}, ...]}\n'
        f"with exactly one entry for each of the episode ids {', '.join(labels)}.")
    parts = [f'<task env="{first.env}" task_id="{first.task_id}">\n{cut_middle(task, cfg.max_task_chars)}\n</task>']
    parts += [f'<episode id="{label}">\n{transcript(by_id[eid], cfg)}\n</episode>' for label, eid in zip(labels, order)]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]
    digest = hashlib.sha256(json.dumps(
        {"prompt_version": PROMPT_VERSION, "model": cfg.model, "temperature": cfg.temperature,
         "max_tokens": cfg.max_tokens, "json_mode": cfg.json_mode, "order": order, "messages": messages},
        sort_keys=True).encode()).hexdigest()
    return JudgeRequest(group_id, order, messages, digest)


def parse_scores(text: str | None, labels: Sequence[str]) -> dict[str, tuple[float, str]]:
    """``{label: (score, explanation)}`` from the judge's answer; :class:`MalformedAnswer` unless
    it is one JSON object ``{"scores": [...]}`` naming every label exactly once, each with a
    finite score in [0, 1]."""
    if not isinstance(text, str) or not text.strip():
        raise MalformedAnswer("the answer is empty")
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise MalformedAnswer(f"the answer is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("scores"), list):
        raise MalformedAnswer('the answer is not an object with a "scores" list')
    want = set(labels)
    out: dict[str, tuple[float, str]] = {}
    for item in obj["scores"]:
        if not isinstance(item, dict):
            raise MalformedAnswer(f"a scores entry is not an object: {item!r:.80}")
        raw_id, score, why = item.get("id"), item.get("score"), item.get("explanation", "")
        if isinstance(raw_id, int):  # a number for a numeric label (True becomes "True": unknown)
            raw_id = str(raw_id)
        if not isinstance(raw_id, str) or raw_id not in want:
            raise MalformedAnswer(f"unknown episode id {item.get('id')!r} (the ids are {', '.join(labels)})")
        if raw_id in out:
            raise MalformedAnswer(f"episode id {raw_id} is scored twice")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                or not 0.0 <= score <= 1.0:
            raise MalformedAnswer(f"episode {raw_id}'s score {score!r} is not a number in [0, 1]")
        if not isinstance(why, str):
            raise MalformedAnswer(f"episode {raw_id}'s explanation is not a string")
        out[raw_id] = (float(score), why)
    missing = [label for label in labels if label not in out]
    if missing:
        raise MalformedAnswer(f"no score for episode id(s) {', '.join(missing)}")
    return out


@dataclass(frozen=True)
class GroupScores:
    """One group's judge scores by episode id; ``cached``: read from the cache, no request."""

    group_id: str
    scores: dict[str, float]
    explanations: dict[str, str]
    cached: bool
    requests: int


@dataclass(frozen=True)
class JudgedIteration:
    """An iteration's judge scores and combined rewards, by episode id, and its metrics."""

    scores: dict[str, float]
    combined: dict[str, float]
    metrics: dict[str, float]

    def rescored(self, episodes: Iterable[Episode]) -> list[Episode]:
        """Copies of ``episodes`` whose ``reward`` is the combined one (what the estimator compares)."""
        return [replace(e, reward=self.combined[e.episode_id]) for e in episodes]


class GroupJudge:
    """Scores groups of episodes through ``cfg``'s endpoint, caching each group's answer under
    ``cache_dir`` (None: no cache). ``fs``: the fsspec filesystem ``cache_dir`` is on (None:
    local). Use :meth:`for_store` in a pipeline; :meth:`close` releases the HTTP client."""

    def __init__(self, cfg: JudgeConfig, cache_dir: str | os.PathLike[str] | None = None, fs: Any = None):
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        if cfg.api_key_env is not None:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"reward.judge.api_key_env={cfg.api_key_env!r}: that environment variable is "
                                 "not set; export it, or set api_key_env: null for a server without a key")
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.Client(timeout=httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 10.0)),
                                    headers=headers)
        self.cache_dir = None if cache_dir is None else str(cache_dir).rstrip("/")
        self._fs = fs
        if fs is None:
            self._local = True
        else:
            from fsspec.implementations.local import LocalFileSystem

            self._local = isinstance(fs, LocalFileSystem)
        self._lock = threading.Lock()
        self.requests = 0  # HTTP requests sent, all groups

    @classmethod
    def for_store(cls, cfg: JudgeConfig, store: TrajectoryStore) -> GroupJudge:
        """A judge caching under the run's store folder: ``{root}/{run_id}/_judge/``."""
        return cls(cfg, store.abs_path(CACHE_DIR), store.fs)

    def close(self) -> None:
        self._client.close()

    # -- cache ---------------------------------------------------------------------------------
    def cache_path(self, stage: int, iteration: int, group_id: str) -> str | None:
        """Where a group's answer is cached (None: no cache). Characters outside [A-Za-z0-9._-]
        in the group id become '_' and a short hash of the id is appended."""
        if self.cache_dir is None:
            return None
        name = _UNSAFE.sub("_", group_id)
        if name != group_id or name.startswith("."):
            name = f"{name}-{hashlib.sha256(group_id.encode()).hexdigest()[:8]}"
        return f"{self.cache_dir}/{int(stage)}-{int(iteration)}/{name}.json"

    def _read_cache(self, path: str) -> dict[str, Any] | None:
        try:
            if self._local:
                raw = Path(path).read_bytes()
            else:
                raw = self._fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            log.warning("judge cache %s is not JSON; asking the judge again", path)
            return None
        return record if isinstance(record, dict) else None

    def _write_cache(self, path: str, record: dict[str, Any]) -> None:
        payload = json.dumps(record, indent=1, sort_keys=True).encode()
        if not self._local:  # an object store's PUT replaces the object whole
            self._fs.pipe_file(path, payload)
            return
        parent = Path(path).parent
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    # -- asking --------------------------------------------------------------------------------
    def _post(self, messages: list[dict[str, str]]) -> httpx.Response:
        body: dict[str, Any] = {"model": self.cfg.model, "messages": messages, "temperature": self.cfg.temperature,
                                "max_tokens": self.cfg.max_tokens, "stream": False}
        if self.cfg.json_mode:
            body["response_format"] = {"type": "json_object"}
        with self._lock:
            self.requests += 1
        return self._client.post(self.url, json=body)

    def ask(self, request: JudgeRequest) -> tuple[dict[str, tuple[float, str]], str, int]:
        """``({label: (score, explanation)}, the answer's text, requests sent)``; retries as
        configured, then :class:`JudgeError`."""
        cfg, where = self.cfg, f"judge {self.cfg.model!r} at {self.url}"
        messages = list(request.messages)
        tries = cfg.max_retries + 1
        last = ""
        for attempt in range(tries):
            if attempt:
                log.warning("%s, group %s, try %d of %d: %s", where, request.group_id, attempt, tries, last)
                time.sleep(min(cfg.retry_backoff_s * 2 ** (attempt - 1), 30.0))
            try:
                r = self._post(messages)
            except httpx.TimeoutException as e:
                last = f"timed out after {cfg.timeout_s:g} s ({type(e).__name__})"
                continue
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                last = f"HTTP {r.status_code}: {r.text[:300]}"
                continue
            if r.status_code >= 400:
                raise JudgeError(f"{where} rejected group {request.group_id}'s request (HTTP {r.status_code}: "
                                 f"{r.text[:300]}); check reward.judge.model and api_key_env")
            try:
                content = r.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError) as e:
                last = f"not a chat completion ({type(e).__name__}: {e})"
                continue
            try:
                return parse_scores(content, request.labels), content, attempt + 1
            except MalformedAnswer as e:
                last = f"malformed answer: {e}"
                if isinstance(content, str):  # say what was wrong: the next try sees its answer and why
                    messages = [*request.messages, {"role": "assistant", "content": content},
                                {"role": "user", "content": f"That answer cannot be used: {e}. Answer again with "
                                 "only the JSON object, one entry for each of the episode ids "
                                 f"{', '.join(request.labels)}."}]
        raise JudgeError(f"{where} gave no valid answer for group {request.group_id} in {tries} tries; "
                         f"last: {last}")

    def score_group(self, group_id: str, episodes: Sequence[Episode], *, stage: int, iteration: int,
                    global_step: int) -> GroupScores:
        """The judge scores of one group's episodes (infra-error episodes must be left out), from
        the cache when it holds this exact request, else asked and then cached."""
        request = build_request(self.cfg, group_id, episodes, global_step)
        path = self.cache_path(stage, iteration, group_id)
        if path is not None:
            record = self._read_cache(path)
            if record is not None and record.get("digest") == request.digest \
                    and set(record.get("scores") or ()) == set(request.order):
                return GroupScores(group_id, {k: float(v) for k, v in record["scores"].items()},
                                   dict(record.get("explanations") or {}), cached=True, requests=0)
            if record is not None:
                log.warning("judge cache %s holds another request (its episodes changed); asking again", path)
        t0 = time.perf_counter()
        parsed, answer, sent = self.ask(request)
        scores = {eid: parsed[label][0] for label, eid in zip(request.labels, request.order)}
        explanations = {eid: parsed[label][1] for label, eid in zip(request.labels, request.order)}
        if path is not None:
            self._write_cache(path, {
                "format": 1, "group_id": group_id, "stage": stage, "iteration": iteration,
                "global_step": global_step, "model": self.cfg.model, "digest": request.digest,
                "order": request.order, "scores": scores, "explanations": explanations, "answer": answer,
                "requests": sent, "seconds": round(time.perf_counter() - t0, 3),
                "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        return GroupScores(group_id, scores, explanations, cached=False, requests=sent)

    def judge_iteration(self, episodes: Sequence[Episode], *, stage: int, iteration: int,
                        global_step: int) -> JudgedIteration:
        """Judge every group of ``episodes`` (infra-error episodes are left out: they are not
        scored), ``max_concurrency`` groups at once, and combine each episode's scores. The
        episodes need their turn text (``read_episodes(turn_text=True)``). Groups answered
        before a failure stay cached; then the first :class:`JudgeError` is raised."""
        t0 = time.perf_counter()
        groups: dict[str, list[Episode]] = {}
        for e in episodes:
            if not e.infra_error:
                groups.setdefault(e.group_id, []).append(e)
        results: list[GroupScores] = []
        errors: list[BaseException] = []
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, max(len(groups), 1)),
                                thread_name_prefix="judge") as pool:
            futures = [pool.submit(self.score_group, g, eps, stage=stage, iteration=iteration,
                                   global_step=global_step) for g, eps in groups.items()]
            for f in futures:
                try:
                    results.append(f.result())
                except BaseException as e:  # noqa: BLE001 - the rest finish (and cache) first
                    errors.append(e)
        if errors:
            raise errors[0]
        scores = {eid: s for r in results for eid, s in r.scores.items()}
        env = {e.episode_id: e.reward for eps in groups.values() for e in eps}
        combined = {eid: combine(self.cfg.alpha, env[eid], s) for eid, s in scores.items()}
        n = len(scores)
        metrics = {
            "judge/score_mean": sum(scores.values()) / n if n else float("nan"),
            "judge/combined_reward_mean": sum(combined.values()) / n if n else float("nan"),
            "judge/groups": float(len(results)),
            "judge/groups_cached": float(sum(r.cached for r in results)),
            "judge/requests": float(sum(r.requests for r in results)),
            "time/judge_s": time.perf_counter() - t0,
        }
        return JudgedIteration(scores, combined, metrics)
