"""Deep Search adapter: AgentGym's searchqa protocol, SQuAD exact match, BM25 over the shipped
corpus, the Search-R1 retrieval-server client, and retriever faults as InfraError."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from env_adapters import InfraError, make_env  # noqa: E402
from env_adapters.deepsearch import (  # noqa: E402
    CORRECT, DATA_DIR, SYSTEM_PROMPT, USER_PROMPT, BM25Retriever, DeepSearchEnv, HTTPRetriever,
    Retriever, bm25_index, em_check, load_corpus, normalize_answer, parse_reply,
    passages_to_string, questions, task_for)


@pytest.fixture(scope="module")
def env():
    e = DeepSearchEnv(split="test")
    yield e
    e.close()


class FakeRetriever:
    def __init__(self, passages=None, error: Exception | None = None):
        self.passages = passages or [{"title": f"T{i}", "text": f"text {i}"} for i in range(5)]
        self.error = error
        self.calls: list[tuple[str, int]] = []

    def search(self, query: str, k: int):
        self.calls.append((query, k))
        if self.error is not None:
            raise self.error
        return self.passages[:k]


# ----------------------------------------------------------------------------- data
def test_shipped_data_is_small_and_consistent():
    corpus = load_corpus()
    assert len(corpus) == 10033 and [d["id"] for d in corpus] == [str(i) for i in range(10033)]
    by_id = {d["id"]: d for d in corpus}
    sizes = {p.name: p.stat().st_size for p in DATA_DIR.iterdir()}
    assert sum(sizes.values()) < 4_000_000, sizes
    assert (DATA_DIR / "LICENSE-DATA.md").exists()
    train, test = questions("train"), questions("test")
    assert (len(train), len(test)) == (491, 127)
    assert {q["gold_titles"][0] for q in train}.isdisjoint(q["gold_titles"][0] for q in test)
    for q in train + test:
        assert q["question"].endswith("?") and q["golden_answers"]
        assert len(q["gold_doc_ids"]) == q["hops"] in (1, 2)
        assert [by_id[i]["title"] for i in q["gold_doc_ids"]] == q["gold_titles"]


def test_task_mapping():
    assert questions("all") == questions("test") + questions("train")
    n = len(questions("train"))
    assert task_for(0) == questions("train")[0] and task_for(n + 3) == task_for(3)
    e = DeepSearchEnv(split="train", retriever=FakeRetriever())
    obs, info = e.reset(5, seed=0)
    q = questions("train")[5]
    assert obs == USER_PROMPT.format(question=q["question"])
    assert obs.endswith("\n\n Question: " + q["question"]) and info["qid"] == q["id"]
    assert e.reset(5, seed=7)[0] == obs  # no randomness: the seed changes nothing
    assert e.system_prompt() == SYSTEM_PROMPT
    assert "golden_answers" not in info
    assert all(a not in json.dumps(info) for a in q["golden_answers"] if len(a) > 4)
    with pytest.raises(ValueError):
        DeepSearchEnv(split="dev")


# ----------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("text, norm", [
    ("The Netherlands", "netherlands"),
    ("  An  apple, a pear & THE plum! ", "apple pear plum"),
    ("D. W. Griffith", "d w griffith"),
    ("Baden-Württemberg", "badenwürttemberg"),
    ("theatre", "theatre"),  # articles only as whole words
    ("1,234.5", "12345"),
    ("", ""),
])
def test_normalize_answer(text, norm):
    assert normalize_answer(text) == norm


def test_em_check():
    assert em_check("the Netherlands", ["Netherlands"]) == 1
    assert em_check("netherlands.", "The Netherlands") == 1
    assert em_check("Paris, France", ["Paris"]) == 0  # exact match, not substring
    assert em_check("Isaac Newton", ["Sir Isaac Newton", "Isaac Newton"]) == 1
    assert em_check("1928", ["1928"]) == 1 and em_check("in 1928", ["1928"]) == 0


@pytest.mark.parametrize("reply, parsed", [
    ("<think>x</think><search> who is X </search>", ("search", "who is X")),
    ("<search>a</search> then <search>b</search>", ("search", "b")),  # the last tag counts
    ("<answer>a</answer><answer> Beijing </answer>", ("answer", "Beijing")),
    ("<answer>\nmulti\nline\n</answer>", ("answer", "multi\nline")),
    ("<search>q</search><answer>a</answer>", (None, "")),  # both kinds
    ("<answer>   </answer>", (None, "")),
    ("<search>unclosed", (None, "")),
    ("Action: look", (None, "")),
    ("", (None, "")),
    ("x" * 9000 + "<answer>a</answer>", (None, "")),
    (None, (None, "")),
])
def test_parse_reply(reply, parsed):
    kind, content, why = parse_reply(reply)
    assert (kind, content) == parsed
    assert bool(why) == (kind is None)


# ----------------------------------------------------------------------------- episodes
def test_gold_answer_gets_reward_1(env):
    for task_id, q in enumerate(questions("test")):
        env.reset(task_id)
        r = env.step(f"<think>I know it.</think>\n<answer> {q['golden_answers'][0]} </answer>")
        assert (r.reward, r.terminated, r.truncated) == (1.0, True, False), q
        assert r.observation == CORRECT and r.info["success"] and not r.info["format_error"]
        assert r.info["golden_answers"] == q["golden_answers"]
        after = env.step("<answer>again</answer>")
        assert after.terminated and after.reward == 0.0
        assert after.observation == "The task is completed."


def test_search_then_answer_two_hops(env):
    two_hop = [(i, q) for i, q in enumerate(questions("test")) if q["hops"] == 2]
    assert two_hop
    for task_id, q in two_hop[:5]:
        env.reset(task_id)
        r1 = env.step(f"<search>{q['question']}</search>")
        assert r1.reward == 0.0 and not r1.terminated and not r1.info["format_error"]
        assert r1.observation.startswith("<information>Doc 1(Title: ")
        assert r1.observation.endswith("</information>") and "\nDoc 3(Title: " in r1.observation
        assert q["gold_doc_ids"][0] in r1.info["retrieved"]
        r2 = env.step(f"<think>bridge</think><search>{q['gold_titles'][1]}</search>")
        assert q["gold_doc_ids"][1] in r2.info["retrieved"] and r2.info["searches"] == 2
        assert any(a in r2.observation for a in q["golden_answers"])
        r3 = env.step(f"<answer>{q['golden_answers'][0]}</answer>")
        assert r3.reward == 1.0 and r3.terminated


def test_wrong_answer_and_format_errors(env):
    env.reset(0)
    bad = env.step("I think it is <answer></answer>")
    assert bad.info["format_error"] and bad.reward == 0.0 and not bad.terminated
    assert bad.observation.startswith("Your previous action is invalid")
    both = env.step("<search>q</search><answer>x</answer>")
    assert both.info["format_error"] and "not both" in both.observation
    wrong = env.step("<answer>certainly not this</answer>")
    assert (wrong.reward, wrong.terminated) == (0.0, True) and wrong.info["success"] is False


def test_answer_terminates_false_allows_retry():
    e = DeepSearchEnv(split="test", retriever=FakeRetriever(), answer_terminates=False)
    q = questions("test")[3]
    e.reset(3)
    r = e.step("<answer>certainly not this</answer>")
    assert (r.reward, r.terminated) == (0.0, False) and "Please try again" in r.observation
    assert "golden_answers" not in r.info
    r = e.step(f"<answer>{q['golden_answers'][-1]}</answer>")
    assert (r.reward, r.terminated) == (1.0, True)


def test_information_format_matches_search_r1():
    fake = FakeRetriever([{"title": "Alpha", "text": "first passage."},
                          {"title": "Beta", "text": "second\npassage."},
                          {"title": "Gamma", "text": "third."}, {"title": "Delta", "text": "x"}])
    e = DeepSearchEnv(retriever=fake, top_k=3)
    e.reset(0)
    r = e.step("<think>t</think>\n<search>  capital of France </search>")
    assert r.observation == ("<information>Doc 1(Title: Alpha) first passage.\n"
                             "Doc 2(Title: Beta) second\npassage.\n"
                             "Doc 3(Title: Gamma) third.</information>")
    assert fake.calls == [("capital of France", 3)] and r.info["query"] == "capital of France"
    assert passages_to_string(fake.passages[:1]) == "Doc 1(Title: Alpha) first passage.\n"
    assert e.valid_actions()[1:] == ["<search>Alpha</search>", "<answer>Alpha</answer>",
                                     "<search>Beta</search>", "<answer>Beta</answer>",
                                     "<search>Gamma</search>", "<answer>Gamma</answer>"]


def test_valid_actions_do_not_leak_the_answer(env):
    for task_id, q in enumerate(questions("test")):
        env.reset(task_id)
        actions = env.valid_actions()
        assert actions == [f"<search>{q['question']}</search>"]
        assert not any(a.startswith("<answer>") for a in actions)


def test_make_env_and_retriever_kinds():
    e = make_env("deepsearch", split="test", top_k=2)
    assert isinstance(e, DeepSearchEnv) and isinstance(e.retriever, BM25Retriever)
    assert isinstance(e.retriever, Retriever)
    with pytest.raises(ValueError):
        DeepSearchEnv(retriever="elasticsearch")
    with pytest.raises(TypeError):
        DeepSearchEnv(retriever=object())
    with pytest.raises(ValueError):
        DeepSearchEnv(top_k=0)


# ----------------------------------------------------------------------------- BM25
def test_bm25_recall_at_3_and_latency():
    r = BM25Retriever()
    index = bm25_index()
    assert r.docs is index.docs  # built once per process, shared
    assert BM25Retriever()._index is index
    for split in ("train", "test"):
        qs = questions(split)
        t0 = time.perf_counter()
        hits = sum(q["gold_doc_ids"][0] in {d["id"] for d in r.search(q["question"], 3)}
                   for q in qs)
        ms = 1000 * (time.perf_counter() - t0) / len(qs)
        print(f"BM25 {split}: recall@3 {hits / len(qs):.3f} ({hits}/{len(qs)}), "
              f"{ms:.2f} ms/query, index built in {index.build_s:.2f} s")
        assert hits / len(qs) >= 0.9
    assert r.search("zzqqxx unknownword", 3) == []
    assert "Oxygen" in [d["title"] for d in r.search("atomic number 8", 3)]  # a 1-digit term


def test_bm25_is_thread_safe_and_deterministic():
    r = BM25Retriever()
    qs = [q["question"] for q in questions("test")[:40]]
    serial = [r.search(q, 3) for q in qs]
    results: dict[int, list] = {}

    def worker(w: int) -> None:
        results[w] = [r.search(q, 3) for q in qs]

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[w] == serial for w in range(4))


# ----------------------------------------------------------------------------- HTTP retriever
class _Handler(BaseHTTPRequestHandler):
    requests: list = []
    mode = "ok"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.requests.append((self.path, body))
        if _Handler.mode == "500":
            self.send_response(500)
            self.end_headers()
            return
        if _Handler.mode == "error":
            payload = {"error": "index not loaded"}
        elif _Handler.mode == "garbage":
            payload = {"nothing": 1}
        else:
            payload = {"result": [
                [{"document": {"id": str(i), "contents": f'"Doc{i}"\ntext of {q}'},
                  "score": 1.0 / (i + 1)} for i in range(body["topk"])]
                for q in body["queries"]]}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    _Handler.requests, _Handler.mode = [], "ok"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    t.join(5)


def test_http_retriever_speaks_search_r1(server):
    r = HTTPRetriever(server, timeout=5)
    assert r.url == server + "/retrieve"
    out = r.search("who wrote Hamlet", 3)
    assert _Handler.requests == [("/retrieve", {"queries": ["who wrote Hamlet"], "topk": 3,
                                                "return_scores": True})]
    assert out[0] == {"title": '"Doc0"', "text": "text of who wrote Hamlet", "id": "0",
                      "score": 1.0}
    assert [len(x) for x in r.search_many(["a", "b"], 2)] == [2, 2]
    r.close()
    r.close()
    # as a URL string the environment owns (and closes) the client
    e = DeepSearchEnv(split="test", retriever=server + "/retrieve")
    e.reset(0)
    res = e.step("<search>Hamlet</search>")
    assert res.observation == ('<information>Doc 1(Title: "Doc0") text of Hamlet\n'
                               'Doc 2(Title: "Doc1") text of Hamlet\n'
                               'Doc 3(Title: "Doc2") text of Hamlet</information>')
    e.close()
    assert e.retriever._client is None


@pytest.mark.parametrize("mode", ["500", "error", "garbage"])
def test_http_retriever_failures_are_infra_errors(server, mode):
    _Handler.mode = mode
    e = DeepSearchEnv(split="test", retriever=HTTPRetriever(server, timeout=5))
    e.reset(0)
    with pytest.raises(InfraError):
        e.step("<search>Hamlet</search>")


def test_retriever_faults_are_infra_errors_not_rewards():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = DeepSearchEnv(split="test", retriever=HTTPRetriever(f"http://127.0.0.1:{port}", timeout=2))
    e.reset(0)
    with pytest.raises(InfraError):
        e.step("<search>Hamlet</search>")
    e.close()
    e = DeepSearchEnv(split="test", retriever=FakeRetriever(error=RuntimeError("index gone")))
    e.reset(0)
    with pytest.raises(InfraError, match="index gone"):
        e.step("<search>Hamlet</search>")
    # a format error or an answer never touches the retriever
    assert not e.step("<answer>x</answer>").info["format_error"]


def _answerable(env, tasks) -> int:
    """Questions of ``tasks`` whose golden answer is a listed ``<answer>`` after searching the
    question itself (the first listed action), then any title it showed."""
    from env_adapters.deepsearch import normalize_answer

    hits = 0
    for t in tasks:
        env.reset(t)
        gold = {normalize_answer(g) for g in env._gold}
        env.step(env.valid_actions()[0])
        titles, listed = list(env._last_titles), set(env.valid_actions())
        for title in titles:
            env.reset(t)
            env.step(env.valid_actions()[0])
            env.step(f"<search>{title}</search>")
            listed |= set(env.valid_actions())
        hits += any(a.startswith("<answer>") and normalize_answer(a[8:-9]) in gold for a in listed)
    return hits


def test_numbers_as_answer_candidates_reach_the_heldout_answers():
    """configs/deepsearch.yaml's 32 held-out questions: titles alone can answer 7, titles and
    the passages' numbers 26 (years, atomic numbers); the numbers are listed once each, only
    after a search, and never a golden answer the passages do not show."""
    import yaml

    cfg = yaml.safe_load((Path(_ROOT) / "configs" / "deepsearch.yaml").read_text())["envs"][0]
    kwargs = {k: v for k, v in cfg.get("kwargs", {}).items() if k != "answer_candidates"}
    titles = make_env("deepsearch", **kwargs, answer_candidates="titles")
    numbers = make_env("deepsearch", **kwargs, answer_candidates="titles+numbers")
    assert _answerable(titles, cfg["eval_tasks"]) == 7
    assert _answerable(numbers, cfg["eval_tasks"]) == 26
    numbers.reset(cfg["eval_tasks"][0])
    assert not any(a.startswith("<answer>") for a in numbers.valid_actions())
    numbers.step(numbers.valid_actions()[0])
    listed = numbers.valid_actions()
    assert len(listed) == len(set(listed))
    with pytest.raises(ValueError, match="answer_candidates must be one of"):
        make_env("deepsearch", answer_candidates="spans")
