"""The gateway's core, without HTTP: every chat request of an episode served from the policy
engine and recorded token-in, token-out as an ``agentgym.types.Episode``.

Per episode the :class:`Gateway` keeps the ids the engine saw and sampled (``Episode.input_ids``
with ``loss_mask`` and the engine's ``old_logprobs``) and the messages they came from. A
request whose messages *extend* the recorded ones (the recorded messages, the last of them the
reply the gateway gave, then tool results or one user message) is prompted with the current
context segment's ids plus the glue of the new messages (``ChatFormatter.tool_glue`` /
``glue``): earlier replies stay the ids that were sampled, never re-encoded. A request that
does not extend them (the agent edited, dropped or reordered its history, or changed the
system prompt or tools) starts a new context segment: the whole message list rendered fresh
(:func:`agentgym.gateway.messages.render_messages`), its offset appended to
``Episode.context_starts`` -- what the rollout's context policies record, so the trainer
trains each segment as the prompt the policy saw. ``Episode.context_starts`` counts them
(``context_segments`` = its length + 1).

Sampling: the policy's (``GatewaySettings.temperature`` / ``top_p``, the trainer recomputes
log-probs at that temperature) unless ``honor_sampling``; the request's ``seed``, else
``episode_turn_seed(seed, episode_id, turn)`` as the rollout's per-episode seeds. All engine
calls go through one :class:`EngineWorker` thread (engines are not thread-safe), which batches
the requests waiting at the same time into one ``generate``.
"""

from __future__ import annotations

import math
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from agentgym.chat import ChatFormatter, ChatTemplateError
from agentgym.gateway.messages import (ChatRequest, Msg, RequestError, render_messages, reply_message,
                                       tool_results)
from agentgym.rollout.engines.base import InferenceEngine, Sample, SamplingParams
from agentgym.rollout.loop import RolloutSettings, episode_turn_seed, state_key
from agentgym.types import Episode, Turn
from env_adapters.tool_calls import render_results_text

EPISODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
AGENT_ENV = "agent"


@dataclass
class GatewaySettings:
    """How the gateway samples and bounds an episode (``from_rollout``: a rollout's settings)."""

    horizon: int = 16  # replies per episode; a request past it is refused (400) and the episode truncated
    max_new_tokens: int = 256  # a reply's budget (a request's max_tokens is capped at it)
    max_context_tokens: int = 4096  # prompt + budget; a longer request is refused and the episode truncated
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop: list[str] = field(default_factory=list)  # unless a request gives its own
    seed: int = 0
    # False: requests' temperature / top_p are ignored (the stored log-probs are the policy's
    # sampling distribution, which the trainer recomputes); True: honored (serving, evaluation)
    honor_sampling: bool = False
    model_name: str = "policy"

    @classmethod
    def from_rollout(cls, settings: RolloutSettings, model_name: str = "policy") -> "GatewaySettings":
        return cls(horizon=settings.horizon, max_new_tokens=settings.max_new_tokens,
                   max_context_tokens=settings.max_context_tokens, temperature=settings.temperature,
                   top_p=settings.top_p, greedy=settings.greedy, stop=list(settings.stop),
                   seed=settings.seed, model_name=model_name)


class EngineWorker:
    """The one thread that calls the engine: requests waiting together go out as one batched
    ``generate`` (one per distinct sampling setting, each row with its own seed), releases in
    order between them. ``on_call(call, rows)``: after each ``generate`` (progress)."""

    def __init__(self, engine: InferenceEngine, max_batch: int = 64,
                 on_call: Callable[[int, int], None] | None = None):
        self.engine = engine
        self.max_batch = max(1, max_batch)
        self.on_call = on_call
        self.calls = 0
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gateway-engine", daemon=True)
        self._closed = False
        self._state = threading.Lock()  # closing and queueing exclude each other
        self._thread.start()

    def generate(self, prompt: list[int], params: SamplingParams, seed: int, key: str) -> Sample:
        """One reply (blocking): ``params`` without seeds, ``seed`` this row's."""
        fut: Future[Sample] = Future()
        with self._state:
            if self._closed:
                raise RuntimeError("the gateway's engine worker is closed")
            self._q.put(("generate", prompt, params, seed, key, fut))
        return fut.result()

    def release(self, keys: Iterable[str]) -> None:
        with self._state:
            if not self._closed:
                self._q.put(("release", list(keys)))

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._q.put(None)  # nothing is queued behind it
        self._thread.join(timeout=60)

    def _refuse_queued(self) -> None:
        """At the stop: requests queued behind a stop re-queued mid-batch get an error, never a hang."""
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0] == "generate":
                item[5].set_exception(RuntimeError("the gateway's engine worker is closed"))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._refuse_queued()
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            gens = [b for b in batch if b[0] == "generate"]
            groups: dict[Any, list[Any]] = {}
            for g in gens:
                p: SamplingParams = g[2]
                key = (p.max_new_tokens, p.temperature, p.top_p, p.greedy, tuple(p.stop_token_ids),
                       tuple(p.stop_strings))
                groups.setdefault(key, []).append(g)
            for rows in groups.values():
                params = replace(rows[0][2], row_seeds=[r[3] for r in rows])
                try:
                    samples = self.engine.generate([r[1] for r in rows], params, cache_keys=[r[4] for r in rows])
                except BaseException as e:  # noqa: BLE001 - every waiting request gets the error
                    for r in rows:
                        r[5].set_exception(e)
                    continue
                self.calls += 1
                for r, s in zip(rows, samples):
                    r[5].set_result(s)
                if self.on_call is not None:
                    try:
                        self.on_call(self.calls - 1, len(rows))
                    except Exception:  # noqa: BLE001 - progress never stops the engine
                        pass
            released = [k for b in batch if b[0] == "release" for k in b[1]]
            if released:
                try:
                    self.engine.release(released)
                except Exception:  # noqa: BLE001 - a cache left behind costs memory, not correctness
                    pass


@dataclass
class _Record:
    ep: Episode
    lock: threading.Lock = field(default_factory=threading.Lock)
    messages: list[Msg] = field(default_factory=list)  # what the current segment's ids came from
    tools: list[dict[str, Any]] | None = None
    seg_start: int = 0
    last_reply: list[int] = field(default_factory=list)
    answered_at: float | None = None  # monotonic time of the last response (the agent's time after it)
    reward: float | None = None
    success: bool | None = None
    error: str | None = None
    ended: bool = False

    @property
    def replies(self) -> int:
        return len(self.ep.turns)


class Gateway:
    """Episodes served from ``engine`` and recorded (see the module doc).

    ``open_episodes``: a request for an unknown episode id starts that episode (``agentgym
    gateway serve``: the agent names its episodes); False: only :meth:`register` ed episodes are
    served (the pipeline's ``agent`` kind). ``on_end(episode)``: called with each finished
    episode (:meth:`finish`). An ended episode's id is refused from then on (404)."""

    def __init__(self, engine: InferenceEngine, formatter: ChatFormatter, settings: GatewaySettings, *,
                 open_episodes: bool = False, on_end: Callable[[Episode], None] | None = None,
                 worker: EngineWorker | None = None):
        self.formatter = formatter
        self.settings = settings
        self.open_episodes = open_episodes
        self.on_end = on_end
        self.worker = worker or EngineWorker(engine)
        self._owns_worker = worker is None
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}  # episodes not finished yet (open, or ended by /end)
        self._gone: set[str] = set()  # episodes whose requests are refused (ended)
        self.segments_started = 0  # new context segments after an edit, over all episodes

    # -- episodes ------------------------------------------------------------------------
    def register(self, episode_id: str, *, group_id: str | None = None, env: str = AGENT_ENV,
                 task_id: int = 0, seed: int = 0, horizon: int | None = None) -> None:
        """Open episode ``episode_id`` (ValueError if the id is malformed or was used)."""
        if not EPISODE_ID.fullmatch(episode_id):
            raise ValueError(f"episode id {episode_id!r}: use 1-200 characters of letters, digits, '.', "
                             "'_', ':' and '-', starting with a letter or digit")
        with self._lock:
            if episode_id in self._records or episode_id in self._gone:
                raise ValueError(f"episode {episode_id!r} is already open or has ended")
            self._records[episode_id] = _Record(Episode(episode_id, group_id or _group_of(episode_id), env,
                                                        task_id, seed, horizon or self.settings.horizon))

    @staticmethod
    def _ended_error(episode_id: str) -> RequestError:
        return RequestError(f"episode {episode_id!r} has ended; start a new episode id", status=404,
                            code="episode_ended", kind="not_found_error")

    def _record(self, episode_id: str, create: bool = False) -> _Record:
        """The open episode ``episode_id`` (opened now where ``create`` and ``open_episodes``);
        RequestError 404 where it is unknown or has ended."""
        with self._lock:
            if episode_id in self._gone:
                raise self._ended_error(episode_id)
            rec = self._records.get(episode_id)
            if rec is not None:
                return rec
            if not (create and self.open_episodes):
                raise RequestError(f"unknown episode {episode_id!r}", status=404, code="unknown_episode",
                                   kind="not_found_error")
            if not EPISODE_ID.fullmatch(episode_id):
                raise RequestError(f"episode id {episode_id!r}: use 1-200 characters of letters, digits, "
                                   "'.', '_', ':' and '-', starting with a letter or digit", status=404,
                                   code="unknown_episode", kind="not_found_error")
            rec = self._records[episode_id] = _Record(Episode(
                episode_id, _group_of(episode_id), AGENT_ENV, 0, self.settings.seed, self.settings.horizon))
            return rec

    def check(self, episode_id: str) -> None:
        """RequestError (404) unless ``episode_id`` is open (or may be opened)."""
        with self._lock:
            if episode_id in self._gone:
                raise self._ended_error(episode_id)
            if episode_id in self._records or (self.open_episodes and EPISODE_ID.fullmatch(episode_id)):
                return
        self._record(episode_id)

    def set_reward(self, episode_id: str, reward: Any, success: Any = None) -> None:
        """The episode's outcome (``POST /reward``): a finite number (clipped to [0, 1] at the
        end); ``success`` a bool (default: reward >= 1)."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RequestError(f"reward must be a finite number, got {reward!r}", param="reward")
        if success is not None and not isinstance(success, bool):
            raise RequestError(f"success must be true or false, got {success!r}", param="success")
        rec = self._record(episode_id, create=True)
        with rec.lock:
            if rec.ended:
                raise self._ended_error(episode_id)
            rec.reward, rec.success = float(reward), success

    def _close(self, episode_id: str) -> _Record:
        """Refuse the episode's requests from now on (404) and drop its engine cache."""
        with self._lock:
            if episode_id in self._gone:
                raise self._ended_error(episode_id)
            rec = self._records.get(episode_id)
            if rec is None:
                raise RequestError(f"unknown episode {episode_id!r}", status=404, code="unknown_episode",
                                   kind="not_found_error")
            self._gone.add(episode_id)
        with rec.lock:  # after a request in flight, if any
            rec.ended = True
        self.worker.release([episode_id])
        return rec

    def end(self, episode_id: str) -> dict[str, Any]:
        """``POST /end``: no request of the episode is served after it. With ``on_end`` (``agentgym
        gateway serve``) the episode is finished now (:meth:`finish`) and handed over; else the
        agent kind finishes it when its agent returns (its return value may be the reward)."""
        rec = self._close(episode_id)
        ep = rec.ep
        if self.on_end is not None:
            ep = self.finish(episode_id)
        return {"episode_id": episode_id, "ended": True, "turns": ep.num_turns, "tokens": len(ep.input_ids),
                "context_segments": len(ep.context_starts) + 1,
                **({"reward": None if ep.infra_error else ep.reward, "success": ep.success,
                    "infra_error": ep.infra_error, "error": ep.error} if self.on_end is not None else {})}

    def finish(self, episode_id: str, *, reward: float | None = None, success: bool | None = None,
               error: str | None = None, agent_error: str | None = None) -> Episode:
        """End the episode (if it is not yet) and return it finished: the reward (``reward``, else
        the posted one) on its last turn, so the turns add up to it, flags settled, validated.
        An ``error``, no reply or no reward make it an infra error (unscored, reward NaN), as the
        rollout records a broken environment. ``agent_error`` (the agent raised): an infra error,
        unless the gateway had cut the episode (horizon, context), which the agent may not
        survive: then it is scored as truncated (the posted reward, else 0). ``on_end`` gets it."""
        with self._lock:
            rec = self._records.pop(episode_id, None)
            if rec is None:
                raise ValueError(f"episode {episode_id!r} is unknown or already finished")
            fresh = episode_id not in self._gone
            self._gone.add(episode_id)
        with rec.lock:
            rec.ended = True
        if fresh:
            self.worker.release([episode_id])
        if reward is not None:
            rec.reward, rec.success = reward, success
        if agent_error is not None and error is None:
            if rec.ep.truncated and rec.ep.turns:
                rec.reward = 0.0 if rec.reward is None else rec.reward
            else:
                error = agent_error
        ep = _finish(rec, error)
        if self.on_end is not None:
            self.on_end(ep)
        return ep

    def open_ids(self) -> list[str]:
        """Episodes whose requests are served (open, not ended)."""
        with self._lock:
            return [k for k in self._records if k not in self._gone]

    def close(self) -> None:
        if self._owns_worker:
            self.worker.close()

    # -- chat ----------------------------------------------------------------------------
    def chat(self, episode_id: str, req: ChatRequest) -> dict[str, Any]:
        """Serve one chat-completions request of episode ``episode_id`` and record it; the
        response body (OpenAI's ``chat.completion``). RequestError: refused (the episode is
        unknown or ended, at its horizon, or the prompt leaves no room for a reply)."""
        rec = self._record(episode_id, create=True)
        with rec.lock:
            if rec.ended:
                raise RequestError(f"episode {episode_id!r} has ended; start a new episode id",
                                   status=404, code="episode_ended", kind="not_found_error")
            return self._chat(rec, req)

    def _plan(self, rec: _Record, req: ChatRequest) -> tuple[list[int] | None, str]:
        """(glue ids, observation) when ``req`` extends the recorded conversation, else
        (None, observation): a new segment."""
        msgs, n = req.messages, len(rec.messages)
        last = msgs[-1]
        observation = render_results_text([{"content": m.text} for m in msgs[_tail_start(msgs):]]) \
            if last.role == "tool" else last.text
        if not rec.messages or len(msgs) <= n or req.tools != rec.tools \
                or not all(a.matches(b) for a, b in zip(rec.messages, msgs[:n])):
            return None, observation
        new = msgs[n:]
        ended = self.formatter.ends_turn(rec.last_reply)
        try:
            if all(m.role == "tool" for m in new):
                results = tool_results(new, rec.messages[-1].calls)
                answered = {r["tool_call_id"] for r in results}  # the calls these results answer, in order
                calls = [c for c in rec.messages[-1].calls if c["id"] in answered]
                return self.formatter.tool_glue(results, ended, calls or None), observation
            if len(new) == 1 and new[0].role == "user":
                return self.formatter.glue(new[0].text, ended), observation
        except ChatTemplateError:
            pass  # this template cannot glue these messages: render them fresh
        return None, observation

    def _chat(self, rec: _Record, req: ChatRequest) -> dict[str, Any]:
        s, ep = self.settings, rec.ep
        now = time.monotonic()
        if rec.replies >= ep.horizon:
            ep.truncated = True
            raise RequestError(f"episode {ep.episode_id!r} reached its horizon of {ep.horizon} replies",
                               code="horizon_reached")
        glue, observation = self._plan(rec, req)
        try:
            head = render_messages(self.formatter, req.messages, req.tools) if glue is None else None
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               param="messages") from None
        prompt = head if head is not None else ep.input_ids[rec.seg_start:] + (glue or [])
        budget = min(req.max_tokens or s.max_new_tokens, s.max_new_tokens)
        if len(prompt) + budget > s.max_context_tokens:
            ep.truncated = True
            raise RequestError(f"the prompt ({len(prompt)} tokens) and the reply budget ({budget}) exceed "
                               f"the context limit of {s.max_context_tokens} tokens",
                               code="context_length_exceeded", param="messages")
        temperature = req.temperature if s.honor_sampling and req.temperature is not None else s.temperature
        greedy = s.greedy if not s.honor_sampling or req.temperature is None else temperature == 0.0
        params = SamplingParams(
            max_new_tokens=budget, temperature=temperature if temperature > 0 else 1.0,
            top_p=req.top_p if s.honor_sampling and req.top_p is not None else s.top_p, greedy=greedy,
            stop_token_ids=list(self.formatter.end_of_turn_ids),
            stop_strings=list(req.stop if req.stop is not None else s.stop))
        turn = rec.replies
        seed = req.seed if req.seed is not None else episode_turn_seed(s.seed, ep.episode_id, turn)
        if rec.answered_at is not None and ep.turns:  # the agent's time since the last reply
            ep.turns[-1].env_latency_ms = (now - rec.answered_at) * 1000.0
        try:
            sample = self.worker.generate(prompt, params, seed, ep.episode_id)
        except Exception as e:  # noqa: BLE001 - the engine failed: the episode is broken, the server is not
            rec.error = f"engine: {type(e).__name__}: {e}"
            raise RequestError(f"the policy engine failed: {type(e).__name__}: {e}", status=500,
                               code="engine_error", kind="server_error") from None
        if head is not None:  # a new context segment: the first, or one after an edited history
            if ep.input_ids:
                ep.context_starts.append(len(ep.input_ids))
                self.segments_started += 1
            rec.seg_start = len(ep.input_ids)
            ep.append(head, sampled=False)
        else:
            ep.append(glue or [], sampled=False)
        ep.append(sample.token_ids, sampled=True, logprobs=sample.logprobs)
        reply = reply_message(self.formatter.reply_text(sample.token_ids), turn)
        ep.turns.append(Turn(
            turn=turn, observation=observation, action_text=reply.text, parsed_action=reply.parsed_action(),
            reward=0.0, terminated=False, truncated=False, format_error=reply.format_error is not None,
            gen_tokens=len(sample.token_ids), env_latency_ms=0.0, state_key=state_key(observation, None)))
        rec.messages = [*req.messages, reply.recorded()]
        rec.tools = req.tools
        rec.last_reply = list(sample.token_ids)
        rec.answered_at = time.monotonic()
        finish = "length" if sample.finish_reason == "length" else "tool_calls" if reply.calls else "stop"
        choice: dict[str, Any] = {"index": 0, "message": reply.message(), "finish_reason": finish,
                                  "logprobs": self._logprobs(sample) if req.logprobs else None}
        return {"id": f"chatcmpl-{ep.episode_id}-{turn}", "object": "chat.completion", "created": int(time.time()),
                "model": s.model_name, "choices": [choice], "system_fingerprint": "agentgym-gateway",
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sample.token_ids),
                          "total_tokens": len(prompt) + len(sample.token_ids)}}

    def _logprobs(self, sample: Sample) -> dict[str, Any]:
        tok = self.formatter.tokenizer
        out = []
        for t, lp in zip(sample.token_ids, sample.logprobs):
            text = str(tok.decode([t]))
            out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")), "top_logprobs": []})
        return {"content": out}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "agentgym"}]}


def _tail_start(msgs: list[Msg]) -> int:
    """Where the run of tool messages that ends ``msgs`` starts."""
    k = len(msgs)
    while k > 0 and msgs[k - 1].role == "tool":
        k -= 1
    return k


def _group_of(episode_id: str) -> str:
    """An episode id's group: the id without its ``-e<sample>`` suffix (the pipeline's naming,
    ``s<step>-g<group>-<env>-<task>[-d<draw>]-e<sample>``), else the id itself."""
    m = re.fullmatch(r"(.+)-e\d+", episode_id)
    return m.group(1) if m else episode_id


def _finish(rec: _Record, error: str | None) -> Episode:
    ep = rec.ep
    error = error or rec.error
    if error is None and not ep.turns:
        error = "the agent made no model call"
    if error is None and rec.reward is None:
        error = "the agent reported no reward (return one from run, or POST /episodes/{id}/reward)"
    if error is not None:
        ep.infra_error, ep.error, ep.reward, ep.success = True, error, float("nan"), False
    else:
        assert rec.reward is not None
        ep.reward = min(1.0, max(0.0, rec.reward))
        ep.success = rec.success if rec.success is not None else ep.reward >= 1.0
        ep.turns[-1].reward = ep.reward
        ep.terminated = not ep.truncated
        ep.turns[-1].terminated, ep.turns[-1].truncated = ep.terminated, ep.truncated
    ep.validate()
    return ep


def outcome(value: Any) -> tuple[float | None, bool | None]:
    """An agent's return value as (reward, success): a number, ``{"reward", "success"?}``, or
    None (it posted its reward itself). ValueError for anything else."""
    if value is None:
        return None, None
    if isinstance(value, Mapping):
        reward, success = value.get("reward"), value.get("success")
        if success is not None and not isinstance(success, bool):
            raise ValueError(f"the agent's success must be a bool, got {success!r}")
    else:
        reward, success = value, None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the agent returned {value!r}: return a finite reward, {{'reward': r, 'success': b}} "
                         "or None (after POST /reward)")
    return float(reward), success
