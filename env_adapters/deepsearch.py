"""Deep Search (AgentGym-RL's ``searchqa``) in-process: question answering with a search tool.

Re-implements ``agentenv-searchqa`` (``agentenv_searchqa/env_wrapper.py``, WooooDyy/AgentGym,
itself the Search-R1 protocol of PeterGriffinJin/Search-R1) over a pluggable retriever:

* **Tasks.** ``task_id`` picks ``questions[task_id % len(questions)]`` of the chosen ``split``
  (``"train"``, ``"test"``, or ``"all"`` = test then train, AgentGym's id order). The questions
  and the passage corpus ship in ``env_adapters/data/deepsearch/`` (built by
  ``env_adapters/data/build_deepsearch.py`` from Wikipedia summaries; see ``LICENSE-DATA.md``).
  The first observation is AgentGym's user prompt ending in ``Question: <question>``; the seed
  changes nothing (there is no randomness).
* **Actions.** The reply's ``<search>query</search>`` or ``<answer>text</answer>``; the LAST
  complete tag counts (Search-R1's ``extract_solution`` also takes the last answer; AgentGym's
  server takes the first). A reply with no tag, an empty tag, both kinds of tag, or more than
  ``max_reply_chars`` characters is a format error (AgentGym's "Your previous action is invalid"
  observation; the turn is consumed).
* **Search.** The retriever's top ``top_k`` passages (3, as in AgentGym) rendered exactly like
  Search-R1's ``_passages2string``: ``<information>Doc 1(Title: T) text\\nDoc 2(Title: ...) ...
  </information>``. A retriever failure raises :class:`InfraError` (never a reward of 0).
* **Answer.** Reward = exact match after SQuAD normalisation (lower case, no punctuation, no
  articles, single spaces) against any golden answer: 1 or 0. By default the answer ends the
  episode (``answer_terminates=True``). AgentGym keeps the episode open after a wrong answer
  ("Sorry, your answer is incorrect. Please try again.", reward 0) -- ``answer_terminates=False``
  does that; a right answer always terminates.
* **Horizon.** AgentGym's SearchQA tooling assumes at most 5 rounds (``MAX_TURNS``, a suggested
  horizon only); the rollout loop owns the cap (``truncated``), the environment never truncates.

Retrievers (``retriever=`` argument): ``None`` or ``"bm25"`` -> :class:`BM25Retriever` over the
shipped corpus (``bm25s``; the index is built once per process and shared by every instance);
an ``http(s)://`` URL -> :class:`HTTPRetriever`, the Search-R1 retrieval server (``POST /retrieve
{queries, topk, return_scores}``), so the real e5 / wiki-18 server replaces BM25; or any object
with ``search(query, k) -> list[{"title", "text"}]`` (:class:`Retriever`).

``valid_actions()`` never names a golden answer: it lists ``<search>`` with the question itself
and, for every passage shown by the last search, ``<search>title</search>`` and
``<answer>title</answer>`` (a candidate the agent has already seen) -- the actions of a
random-valid-action baseline, not a game rule. With ``answer_candidates="titles+numbers"`` it
also lists ``<answer>n</answer>`` for every number of one to four digits in those passages (in
order of appearance, each once). Why: 25 of the 32 held-out questions of configs/deepsearch.yaml
ask for a year, an atomic number or a symbol, so with titles alone at most 7 of them can be
answered by a listed action (``tests/env_adapters/test_deepsearch.py``).
"""

from __future__ import annotations

import gzip
import json
import re
import string
import threading
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

from env_adapters.base import InfraError, StepResult, TextEnv, format_error

DATA_DIR = Path(__file__).resolve().parent / "data" / "deepsearch"
CORPUS_PATH = DATA_DIR / "corpus.jsonl.gz"
SPLITS = ("train", "test")
#: ``answer_candidates`` values: the answers ``valid_actions()`` lists (module docstring)
ANSWER_CANDIDATES = ("titles", "titles+numbers")
_NUMBER = re.compile(r"(?<![\w.,])\d{1,4}(?![\w]|[.,]\d)")
DEFAULT_TOP_K = 3  # SEARCHQA_RETRIEVAL_TOPK in agentenv-searchqa
MAX_TURNS = 5  # suggested horizon (AgentGym's SearchQA viewer); the rollout loop enforces it
MAX_REPLY_CHARS = 8000

#: The human turn of AgentGym's ``SearchQAEnvClient.conversation_start``
#: (agentenv/envs/searchqa.py).
SYSTEM_PROMPT = (
    "You must always reason inside <think>...</think> first; if you lack knowledge, issue a "
    "<search>...</search> and then stop; do not generate <information> or <answer> yet; wait "
    "for external input between <information>...</information> before continuing; resume only "
    "when new <information> is given; do not skip steps or anticipate answers early."
)
#: ``SearchQAEnvServer.observation`` (agentenv_searchqa/env_wrapper.py), verbatim.
USER_PROMPT = (
    "You must reason inside <think>...</think> first. If you do not have enough knowledge, issue"
    " a <search>...</search> and then STOP. Do not generate <information> or <answer> yet. Wait "
    "for external input wrapped in <information>...</information>. After receiving information, "
    "reason again in <think>. If confident, output your final answer in <answer>...</answer>. Do"
    " not output <answer> before receiving <information> unless you are fully confident. If you "
    "find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Follow this process every time.\n\n Question: {question}"
)
INVALID_ACTION = (
    "Your previous action is invalid{why}. If you want to search, you should put the query "
    "between <search> and </search>. If you want to give the final answer, you should put the "
    "answer between <answer> and </answer>. Please try again."
)
CORRECT = "Congratulations! You have answered the question correctly."
INCORRECT_RETRY = "Sorry, your answer is incorrect. Please try again."
INCORRECT_FINAL = "Sorry, your answer is incorrect."
NO_RESULTS = "No results found."

_PUNCT = frozenset(string.punctuation)
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


# ----------------------------------------------------------------------------- scoring
def normalize_answer(s: str) -> str:
    """SQuAD normalisation (Search-R1 ``qa_em.normalize_answer``): lower case, drop punctuation,
    drop the articles a/an/the, collapse white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def em_check(prediction: str, golden_answers: str | Iterable[str]) -> int:
    """1 if the normalised prediction equals a normalised golden answer, else 0."""
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in golden_answers))


def parse_reply(reply: Any, max_chars: int = MAX_REPLY_CHARS) -> tuple[str | None, str, str]:
    """``(kind, content, why)``: kind is ``"search"``/``"answer"``, or None with the reason."""
    if not isinstance(reply, str):
        return None, "", " (the reply is not text)"
    if len(reply) > max_chars:
        return None, "", f" (the reply is longer than {max_chars} characters)"
    matches = list(_TAG.finditer(reply))
    if not matches:
        return None, "", " (no <search> or <answer> tag)"
    if len({m.group(1) for m in matches}) > 1:
        return None, "", " (use either <search> or <answer>, not both)"
    kind, content = matches[-1].group(1), matches[-1].group(2).strip()
    if not content:
        return None, "", f" (the <{kind}> tag is empty)"
    return kind, content, ""


# ----------------------------------------------------------------------------- retrievers
@runtime_checkable
class Retriever(Protocol):
    """``search(query, k)`` -> up to ``k`` passages ``{"title": str, "text": str}``, best first.

    Raise anything on failure: the environment turns it into :class:`InfraError`."""

    def search(self, query: str, k: int) -> list[dict[str, str]]: ...


def load_corpus(path: str | Path = CORPUS_PATH) -> list[dict[str, str]]:
    """The ``{id, title, text}`` passages of a JSONL file (gzipped when it ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


_TOKEN = re.compile(r"(?u)\b(?:\w\w+|\d)\b")


@lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without accents or English stop words (BM25's analyser);
    single characters are dropped, single digits kept (``atomic number 8``)."""
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    stop = _stopwords()
    return [t for t in _TOKEN.findall(text) if t not in stop]


@dataclass
class _Index:
    docs: list[dict[str, str]]
    bm25: Any
    build_s: float


_INDEXES: dict[str, _Index] = {}
_INDEX_LOCK = threading.Lock()


def bm25_index(corpus_path: str | Path = CORPUS_PATH) -> _Index:
    """The BM25 index of ``corpus_path``, built on first use and cached for the process."""
    import time

    key = str(Path(corpus_path).resolve())
    with _INDEX_LOCK:
        index = _INDEXES.get(key)
        if index is None:
            import bm25s

            t0 = time.perf_counter()
            docs = load_corpus(corpus_path)
            bm25 = bm25s.BM25()  # Lucene variant, k1=1.5, b=0.75
            bm25.index([tokenize(d["title"] + " " + d["text"]) for d in docs],
                       show_progress=False)
            index = _INDEXES[key] = _Index(docs, bm25, time.perf_counter() - t0)
        return index


class BM25Retriever:
    """BM25 (``bm25s``) over a local passage corpus; instances share one index per corpus.

    ``search`` only reads the index (numpy), so it is safe from many threads at once. Ties are
    broken by corpus order, so results are deterministic. A query with no indexed term returns
    no passage."""

    def __init__(self, corpus_path: str | Path = CORPUS_PATH) -> None:
        self.corpus_path = Path(corpus_path)
        self._index = bm25_index(self.corpus_path)

    @property
    def docs(self) -> list[dict[str, str]]:
        return self._index.docs

    def search(self, query: str, k: int = DEFAULT_TOP_K) -> list[dict[str, Any]]:
        """Passages with their ``id`` and BM25 ``score`` (a float) besides title and text."""
        import numpy as np

        index = self._index
        ids = index.bm25.get_tokens_ids(tokenize(query))
        if not ids or k <= 0:
            return []
        scores = np.asarray(index.bm25.get_scores_from_ids(ids))
        k = min(k, len(scores))
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        cand = np.flatnonzero(scores >= kth)
        cand = cand[np.lexsort((cand, -scores[cand]))][:k]
        return [{"id": index.docs[i]["id"], "title": index.docs[i]["title"],
                 "text": index.docs[i]["text"], "score": float(scores[i])}
                for i in cand.tolist() if scores[i] > 0]


class HTTPRetriever:
    """A Search-R1 retrieval server (``search_r1/search/retrieval_server.py``, e5 over wiki-18):
    ``POST {url} {"queries": [q], "topk": k, "return_scores": true}`` ->
    ``{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}``; ``contents`` is the title
    line, a newline, then the text (``title``/``text`` keys are accepted too). ``/retrieve`` is
    appended to ``url`` unless it already ends with it. Any HTTP, network or shape error raises
    :class:`InfraError`; the client is thread-safe and ``close()`` releases its connections."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        url = url.rstrip("/")
        if not url.endswith("/retrieve"):
            url += "/retrieve"
        self.url = url
        self.timeout = timeout
        self._client: Any = None
        self._lock = threading.Lock()

    def _http(self) -> Any:
        import httpx

        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self.timeout)
            return self._client

    def search(self, query: str, k: int = DEFAULT_TOP_K) -> list[dict[str, str]]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: list[str], k: int = DEFAULT_TOP_K) -> list[list[dict[str, str]]]:
        payload = {"queries": list(queries), "topk": int(k), "return_scores": True}
        try:
            res = self._http().post(self.url, json=payload)
            res.raise_for_status()
            body = res.json()
        except Exception as e:  # noqa: BLE001 - every transport failure is an infra fault
            raise InfraError(f"retrieval server {self.url}: {type(e).__name__}: {e}") from e
        try:
            if isinstance(body, dict) and "error" in body:
                raise ValueError(f"server error: {body['error']}")
            results = body["result"]
            if len(results) != len(queries):
                raise ValueError(f"{len(results)} results for {len(queries)} queries")
            return [[self._passage(item) for item in per_query] for per_query in results]
        except InfraError:
            raise
        except Exception as e:  # noqa: BLE001
            raise InfraError(f"retrieval server {self.url}: bad response: {e}") from e

    @staticmethod
    def _passage(item: dict[str, Any]) -> dict[str, str]:
        doc = item.get("document", item)
        if "contents" in doc:
            title, _, text = str(doc["contents"]).partition("\n")
        else:
            title, text = str(doc["title"]), str(doc["text"])
        out = {"title": title, "text": text}
        if "id" in doc:
            out["id"] = str(doc["id"])
        if "score" in item:
            out["score"] = item["score"]
        return out

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def passages_to_string(passages: list[dict[str, str]]) -> str:
    """Search-R1's ``_passages2string``: ``Doc i(Title: t) text`` lines."""
    return "".join(f"Doc {i + 1}(Title: {p['title']}) {p['text']}\n"
                   for i, p in enumerate(passages))


# ----------------------------------------------------------------------------- tasks
@lru_cache(maxsize=None)
def _load_split(split: str) -> tuple[dict[str, Any], ...]:
    with open(DATA_DIR / f"{split}.jsonl", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def questions(split: str = "train") -> tuple[dict[str, Any], ...]:
    """The questions of ``split`` (``"all"`` = test then train), in ``task_id`` order."""
    if split == "all":
        return _load_split("test") + _load_split("train")
    if split not in SPLITS:
        raise ValueError(f"deepsearch: split must be one of {SPLITS + ('all',)}, got {split!r}")
    return _load_split(split)


def task_for(task_id: int, split: str = "train") -> dict[str, Any]:
    qs = questions(split)
    return qs[int(task_id) % len(qs)]


# ----------------------------------------------------------------------------- environment
class DeepSearchEnv(TextEnv):
    """One Deep Search episode at a time (see the module docstring)."""

    name = "deepsearch"

    def __init__(self, split: str = "train", top_k: int = DEFAULT_TOP_K,
                 retriever: Retriever | str | None = None, answer_terminates: bool = True,
                 max_reply_chars: int = MAX_REPLY_CHARS, answer_candidates: str = "titles") -> None:
        self.questions = questions(split)  # validates the split
        if answer_candidates not in ANSWER_CANDIDATES:
            raise ValueError(f"deepsearch: answer_candidates must be one of {ANSWER_CANDIDATES}, not "
                             f"{answer_candidates!r} (envs[].kwargs.answer_candidates)")
        self.list_numbers = answer_candidates == "titles+numbers"
        self.split = split
        if int(top_k) < 1:
            raise ValueError("deepsearch: top_k must be >= 1")
        self.top_k = int(top_k)
        self.answer_terminates = answer_terminates
        self.max_reply_chars = max_reply_chars
        self._owns_retriever = False
        if retriever is None or retriever == "bm25":
            retriever = BM25Retriever()
        elif isinstance(retriever, str):
            if not retriever.startswith(("http://", "https://")):
                raise ValueError(f"deepsearch: retriever must be 'bm25', a URL or an object "
                                 f"with search(query, k), got {retriever!r}")
            retriever = HTTPRetriever(retriever)
            self._owns_retriever = True
        elif not isinstance(retriever, Retriever):
            raise TypeError("deepsearch: the retriever needs a search(query, k) method")
        self.retriever = retriever
        self._ready = False
        self._closed = False

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def valid_actions(self) -> list[str] | None:
        if not self._ready:
            return None
        actions = [f"<search>{self.task['question']}</search>"]
        for title in self._last_titles:
            actions.append(f"<search>{title}</search>")
            actions.append(f"<answer>{title}</answer>")
        if self.list_numbers:
            actions += [f"<answer>{n}</answer>" for n in self._last_numbers]
        return actions

    # ------------------------------------------------------------------ reset
    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if task_id < 0 or seed < 0:
            raise ValueError("task_id and seed must be >= 0")
        if self._closed:
            raise RuntimeError("environment is closed")
        q = self.questions[int(task_id) % len(self.questions)]
        self._gold = list(q["golden_answers"])
        self.task = {"task_id": int(task_id), "seed": int(seed), "split": self.split,
                     "qid": q["id"], "question": q["question"], "type": q.get("type"),
                     "hops": q.get("hops")}
        self._last_titles: list[str] = []
        self._last_numbers: list[str] = []
        self.searches = 0
        self.done = False
        self._ready = True
        return USER_PROMPT.format(question=q["question"].strip()), {**self.task, "success": False}

    # ------------------------------------------------------------------ step
    def step(self, action_text: str) -> StepResult:
        if not self._ready:
            raise RuntimeError("call reset() before step()")
        base = {**self.task, "success": self.done, "invalid_action": False,
                "format_error": False, "parsed_action": None, "searches": self.searches}
        if self.done:
            return StepResult("The task is completed.", 0.0, True, False, base)
        kind, content, why = parse_reply(action_text, self.max_reply_chars)
        if kind is None:
            return format_error(INVALID_ACTION.format(why=why), **{**base, "format_error": True})
        base["parsed_action"] = f"<{kind}>{content}</{kind}>"
        if kind == "search":
            passages = self._search(content)
            self.searches += 1
            self._last_titles = [p["title"] for p in passages]
            self._last_numbers = list(dict.fromkeys(
                n for p in passages for n in _NUMBER.findall(p.get("text", "")) if n not in self._last_titles))
            body = passages_to_string(passages).strip() or NO_RESULTS
            info = {**base, "searches": self.searches, "query": content,
                    "retrieved": [p.get("id", p["title"]) for p in passages]}
            return StepResult(f"<information>{body}</information>", 0.0, False, False, info)
        correct = bool(em_check(content, self._gold))
        self.done = correct or self.answer_terminates
        if correct:
            obs = CORRECT
        else:
            obs = INCORRECT_FINAL if self.answer_terminates else INCORRECT_RETRY
        info = {**base, "success": correct, "answer": content}
        if self.done:
            info["golden_answers"] = list(self._gold)
        return StepResult(obs, float(correct), self.done, False, info)

    def _search(self, query: str) -> list[dict[str, str]]:
        try:
            passages = self.retriever.search(query, self.top_k)
            out = [{**p, "title": str(p["title"]).strip(), "text": str(p["text"]).strip()}
                   for p in list(passages)[: self.top_k]]
        except InfraError:
            raise
        except Exception as e:  # noqa: BLE001 - a retriever fault is not the agent's
            raise InfraError(f"deepsearch retriever failed: {type(e).__name__}: {e}") from e
        return out

    def close(self) -> None:
        self._ready = False
        if not self._closed and self._owns_retriever:
            close = getattr(self.retriever, "close", None)
            if callable(close):
                close()
        self._closed = True
