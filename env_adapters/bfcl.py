"""BFCL's multi-turn categories (Berkeley Function-Calling Leaderboard v4) as a tool-calling
environment: 800 tasks over 8 stateful API classes (a file system, a trading bot, travel
booking, vehicle control, messaging, posting, tickets, maths).

``bfcl-eval`` (2026.3.23) supplies the data files it ships (the tasks, their ground truth and the
function docs) and its API classes; it is installed with ``--no-deps`` (scripts/setup.sh) because
it pins numpy 1.26, and the parts used here need only the standard library and mpmath. Its
single-turn checker, which imports every model API client, is never imported.

**Task ids.** ``task_id = category index * 200 + k``, with the categories in :data:`CATEGORIES`
order (``multi_turn_base`` 0-199, ``multi_turn_miss_param`` 200-399, ``multi_turn_miss_func``
400-599, ``multi_turn_long_context`` 600-799) and ``k`` BFCL's entry number (``multi_turn_base_k``).
``task_category`` is the BFCL category. The three variant categories are built from base task
``k``, so :func:`split_task_ids` holds out every ``k`` with ``k % 5 == 0`` in all four categories
at once (160 held-out ids, 640 training ids): no base task is on both sides.

**An episode.** Each user turn of the task is one request: the first is the reset observation,
the next ones are the result of the ``finish_turn`` tool, which ends the current turn. Each
episode builds its own instances of the task's API classes (``_load_scenario`` with a deep copy
of the task's ``initial_config``, as BFCL does), and a second, separate set for the ground truth.
A call is run *by name*: the name must be one of the functions the task offers at that turn
(the docs of its classes; ``multi_turn_miss_func`` offers its held-back functions at their turn,
with BFCL's "I have updated some more functions" message; one called before it is run all the
same, as BFCL's executor runs any method of the task's classes: ``multi_turn_miss_func_49``'s
ground truth calls ``tail`` two turns early), its arguments are checked against
the function doc (an unknown one, or a missing required one, is a :class:`ToolError`), and the
method of the episode's own instance is called with them as keyword arguments. Nothing the
model writes is evaluated: BFCL's ``eval``-based executor (which also shares instances across
calls of one process) is never used. Results are turned into text as BFCL's executor does
(``str``; a dict as JSON; an exception as ``Error during execution: ...``).

**Judging a turn** (at ``finish_turn``): the turn's ground-truth calls are replayed on the
ground-truth instances, then BFCL's own ``state_checker`` (every public attribute of every
instance equal) and ``response_checker`` (each ground-truth result of this turn among the
model's results of all turns so far) judge it, as ``multi_turn_checker`` does; a turn whose
ground truth has calls also fails when the model made none in it. A turn with no ground-truth
calls (where ``miss_param`` / ``miss_func`` expect the model to say it cannot go on) is not
judged, as in BFCL; the next turn's state check sees what the model did in it.

**Reward** (``reward="strict"``, BFCL's accuracy): 1 when every judged turn passes, and the
episode ends at the first turn that fails (its outcome is decided). ``reward="partial"``: the
share of judged turns that pass, every turn played. ``success``: every judged turn passed.

**Context.** Tool descriptions take a median of 2,685 and at most 4,218 SmolLM2 tokens with
each class's preamble stripped (the preamble is said once, in the system prompt): give
``rollout.max_context_tokens`` 8192.

``valid_actions()`` is a partial list, for the random-valid baseline and the conformance
check: ``finish_turn`` and every available function that needs no argument, called without
any. A complete list cannot be built: 27 % of the ground truth's string arguments appear
neither in the query nor in the starting state.
"""

from __future__ import annotations

import ast
import copy
import decimal
import functools
import importlib
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from env_adapters.tool_calls import ToolCall, ToolEnv, ToolError, ToolOutcome, tool_schema

#: BFCL's multi-turn categories, in task-id order (category index * 200 + k)
CATEGORIES = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_miss_func", "multi_turn_long_context")
TASKS_PER_CATEGORY = 200
NUM_TASKS = len(CATEGORIES) * TASKS_PER_CATEGORY
#: base task k is held out when k % HELDOUT_EVERY == 0 (all its variants with it)
HELDOUT_EVERY = 5
BFCL_VERSION = "2026.3.23"
FINISH_TURN = "finish_turn"
#: BFCL's message for a turn that brings the held-back functions of ``miss_func``
#: (bfcl_eval.constants.default_prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC)
ADDED_FUNCTIONS_MESSAGE = "I have updated some more functions you can choose from. What about now?"
_DOC_PREAMBLE_SPLIT = "Tool description: "
_BACKEND = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
_CHECKER = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker"
# BFCL's types -> JSON schema's, in the tools the model sees
_SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}
# arguments that would hang a call (or the whole process: the maths API sets mpmath's and the
# decimal module's precision): (function, argument) -> the largest magnitude allowed
_ARG_LIMITS = {("logarithm", "precision"): 1000, ("square_root", "precision"): 1000,
               ("power", "exponent"): 10_000}
_MAX_NAME_SHOWN = 60
# The API classes are not thread-safe where they touch process-wide state (mpmath.mp.dps, the
# decimal context): calls run one at a time (each takes microseconds), with that state restored.
_CALL_LOCK = threading.Lock()


def bfcl_missing() -> str | None:
    """Why BFCL cannot run here (``None``: it can)."""
    try:
        importlib.import_module(f"{_BACKEND}.gorilla_file_system")
        importlib.import_module(_CHECKER)
    except ImportError as e:
        return (f"bfcl-eval is not installed ({e}); install it without its dependencies: "
                f"pip install --no-deps bfcl-eval=={BFCL_VERSION} (scripts/setup.sh does)")
    return None


def _bfcl(module: str) -> Any:
    if why := bfcl_missing():
        raise RuntimeError(why)
    return importlib.import_module(module)


# ---------------------------------------------------------------------------------- task ids


def task_id_of(category: str, k: int) -> int:
    """The task id of BFCL entry ``{category}_{k}``."""
    if category not in CATEGORIES or not 0 <= k < TASKS_PER_CATEGORY:
        raise ValueError(f"no BFCL task {category}_{k}: categories {CATEGORIES}, k in 0..{TASKS_PER_CATEGORY - 1}")
    return CATEGORIES.index(category) * TASKS_PER_CATEGORY + k


def _check_id(task_id: int) -> int:
    if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < NUM_TASKS:
        raise ValueError(f"BFCL task ids are 0..{NUM_TASKS - 1} (category index * 200 + k), got {task_id!r}")
    return task_id


def category_of(task_id: int) -> str:
    return CATEGORIES[_check_id(task_id) // TASKS_PER_CATEGORY]


def base_task(task_id: int) -> int:
    """``k``: the base task ``task_id`` is built from (its variants share it)."""
    return _check_id(task_id) % TASKS_PER_CATEGORY


def is_heldout(task_id: int) -> bool:
    return base_task(task_id) % HELDOUT_EVERY == 0


def split_task_ids(categories: tuple[str, ...] | list[str] = CATEGORIES) -> tuple[list[int], list[int]]:
    """``(train, heldout)`` task ids of ``categories``, split by base task: ``k % 5 == 0`` is held
    out, in every category, so the variants of one base task are all on one side."""
    ids = [task_id_of(c, k) for c in categories for k in range(TASKS_PER_CATEGORY)]
    return [i for i in ids if not is_heldout(i)], [i for i in ids if is_heldout(i)]


# ---------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class _Function:
    name: str
    class_name: str
    properties: tuple[str, ...]
    required: frozenset[str]
    tool: dict[str, Any]  # OpenAI function format, the class preamble stripped


@dataclass(frozen=True)
class _Data:
    entries: tuple[dict[str, Any], ...]         # by task id; never mutated (deep-copied per use)
    ground_truth: tuple[tuple[tuple[tuple[str, dict[str, Any]], ...], ...], ...]  # task -> turn -> calls
    functions: dict[str, dict[str, _Function]]  # class -> name -> function
    preambles: dict[str, str]                   # class -> its docs' common preamble


def _schema(node: Any) -> Any:
    """A BFCL parameter doc as JSON schema (``dict`` -> ``object``, ``float`` -> ``number``)."""
    if isinstance(node, dict):
        out = {k: _schema(v) for k, v in node.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _SCHEMA_TYPES.get(out["type"], out["type"])
        if "properties" in node and isinstance(node["properties"], dict):
            out["properties"] = {k: _schema(v) for k, v in node["properties"].items()}
        return out
    if isinstance(node, list):
        return [_schema(v) for v in node]
    return node


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _parse_call(text: str, method: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """A ground-truth call string (``mv(source='a', destination='b')``, positional arguments
    too) as ``(name, keyword arguments)``: parsed with ``ast`` and ``literal_eval`` (data from
    the bfcl-eval wheel, still never evaluated), positional arguments named by the signature."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    sig = inspect.signature(method)  # the class's function: its first parameter is self
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return node.func.id, dict(sig.bind(*args, **kwargs).arguments)


@functools.lru_cache(maxsize=1)
def load_data() -> _Data:
    """The 800 tasks, their ground truth and the function docs, from the bfcl-eval wheel."""
    cfg = _bfcl("bfcl_eval.constants.eval_config")
    backend = _bfcl("bfcl_eval.constants.executable_backend_config")
    prompt_dir, answer_dir, doc_dir = (Path(cfg.PROMPT_PATH), Path(cfg.POSSIBLE_ANSWER_PATH),
                                       Path(cfg.MULTI_TURN_FUNC_DOC_PATH))
    entries: list[dict[str, Any]] = []
    answers: list[list[list[str]]] = []
    for category in CATEGORIES:
        tasks = _read_jsonl(prompt_dir / f"BFCL_v4_{category}.json")
        truth = {a["id"]: a["ground_truth"] for a in _read_jsonl(answer_dir / f"BFCL_v4_{category}.json")}
        want = [f"{category}_{k}" for k in range(TASKS_PER_CATEGORY)]
        if [t["id"] for t in tasks] != want:
            raise RuntimeError(f"bfcl-eval's {category} file is not {category}_0..{TASKS_PER_CATEGORY - 1} "
                               f"in order; this adapter reads bfcl-eval {BFCL_VERSION}")
        for t in tasks:
            if len(truth[t["id"]]) != len(t["question"]):
                raise RuntimeError(f"{t['id']}: {len(t['question'])} user turns, "
                                   f"{len(truth[t['id']])} ground-truth turns")
            entries.append(t)
            answers.append(truth[t["id"]])
    classes = sorted({c for t in entries for c in t["involved_classes"]})
    functions: dict[str, dict[str, _Function]] = {}
    preambles: dict[str, str] = {}
    for class_name in classes:
        docs = _read_jsonl(doc_dir / backend.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name])
        pre, found = set(), {}
        for d in docs:
            head, _, desc = d["description"].rpartition(_DOC_PREAMBLE_SPLIT)
            pre.add(head.strip())
            params = d["parameters"]
            found[d["name"]] = _Function(
                d["name"], class_name, tuple(params.get("properties", {})), frozenset(params.get("required", [])),
                tool_schema(d["name"], desc.strip() or d["description"], _schema(params)))
        functions[class_name] = found
        preambles[class_name] = " ".join(sorted(p for p in pre if p))
    # every ground-truth call, parsed once (names checked against the docs)
    methods: dict[str, Callable[..., Any]] = {}
    for class_name in classes:
        cls = getattr(importlib.import_module(backend.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        methods.update({name: getattr(cls, name) for name in functions[class_name]})
    truth_calls = []
    for t, turns in zip(entries, answers):
        offered = {n for c in t["involved_classes"] for n in functions[c]}
        parsed = []
        for turn in turns:
            calls = []
            for text in turn:
                name, kwargs = _parse_call(text, methods[text.split("(", 1)[0].strip()])
                if name not in offered:
                    raise RuntimeError(f"{t['id']}: ground-truth call {text!r} names no function of its classes")
                calls.append((name, kwargs))
            parsed.append(tuple(calls))
        truth_calls.append(tuple(parsed))
    return _Data(tuple(entries), tuple(truth_calls), functions, preambles)


def ground_truth_calls(task_id: int) -> list[list[tuple[str, dict[str, Any]]]]:
    """The ground truth of ``task_id``: per user turn, its calls as ``(name, keyword arguments)``
    (fresh copies)."""
    return [[(n, copy.deepcopy(a)) for n, a in turn] for turn in load_data().ground_truth[_check_id(task_id)]]


# ---------------------------------------------------------------------------------- execution


def _result_text(result: Any) -> str:
    """A call's result as BFCL's executor writes it (multi_turn_utils.execute_multi_turn_func_call)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:  # noqa: BLE001 - BFCL's fallback: some results hold mpmath / Decimal values
            return str(result)
    return str(result)


def _run_method(method: Callable[..., Any], kwargs: dict[str, Any]) -> str:
    """Call one bound API method with keyword arguments and return its result text; an exception
    in it is a result, as in BFCL. One call at a time, mpmath's precision and the decimal
    context restored afterwards (the maths API sets both)."""
    mpmath = importlib.import_module("mpmath")
    with _CALL_LOCK:
        dps = mpmath.mp.dps
        try:
            with decimal.localcontext():
                return _result_text(method(**kwargs))  # the text too: mpmath's repr reads dps
        except Exception as e:  # noqa: BLE001 - the tool's own error is the model's observation
            return f"Error during execution: {e}"
        finally:
            mpmath.mp.dps = dps


class _Instances:
    """One set of the task's API class instances, built as BFCL builds them; calls by name."""

    def __init__(self, entry: dict[str, Any], functions: dict[str, dict[str, _Function]]):
        backend = importlib.import_module("bfcl_eval.constants.executable_backend_config")
        long_context = "long_context" in entry["id"]
        self.objects: dict[str, Any] = {}
        self.methods: dict[str, Callable[..., Any]] = {}
        for class_name in entry["involved_classes"]:
            cls = getattr(importlib.import_module(backend.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
            obj = cls()
            if class_name not in backend.STATELESS_CLASSES:
                obj._load_scenario(copy.deepcopy(entry["initial_config"].get(class_name, {})),
                                   long_context=long_context)
            self.objects[class_name] = obj
            for name in functions[class_name]:  # only documented functions, looked up in a dict
                self.methods[name] = getattr(obj, name)

    def call(self, name: str, kwargs: dict[str, Any]) -> str:
        return _run_method(self.methods[name], copy.deepcopy(kwargs))


# ---------------------------------------------------------------------------------- environment


class BFCLEnv(ToolEnv):
    """BFCL multi-turn as a ``ToolEnv`` (module docstring: ids, turns, judging, reward)."""

    name = "bfcl"

    def __init__(self, reward: Literal["strict", "partial"] = "strict"):
        if reward not in ("strict", "partial"):
            raise ValueError(f"bfcl: reward must be 'strict' or 'partial', got {reward!r}")
        self.reward_mode = reward
        self._data = load_data()
        checker = _bfcl(_CHECKER)
        self._state_checker = checker.state_checker
        self._response_checker = checker.response_checker
        self._task = -1
        self._done = True
        self._entry: dict[str, Any] = {}
        self._model: _Instances | None = None
        self._truth: _Instances | None = None
        self._available: dict[str, _Function] = {}  # offered to the model (tools())
        self._callable: dict[str, _Function] = {}   # every function of the task's classes
        self._held_back: dict[int, list[str]] = {}
        self._user_turn = 0
        self._turn_calls = 0
        self._finished_at = -1
        self._model_results: list[str] = []
        self._verdicts: list[bool | None] = []

    # ---- the episode

    @classmethod
    def task_category(cls, task_id: int) -> str:
        return category_of(task_id)

    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self._task = _check_id(int(task_id))
        self._entry = self._data.entries[self._task]
        funcs = self._data.functions
        self._model = _Instances(self._entry, funcs)
        self._truth = _Instances(self._entry, funcs)
        self._held_back = {int(t): list(names) for t, names in self._entry.get("missed_function", {}).items()}
        held = {n for names in self._held_back.values() for n in names}
        self._callable = {n: f for c in self._entry["involved_classes"] for n, f in funcs[c].items()}
        self._available = {n: f for n, f in self._callable.items() if n not in held}
        self._user_turn = 0
        self._turn_calls = 0
        self._finished_at = -1
        self._model_results = []
        self._verdicts = []
        self._done = False
        return self._question(0), {"task_id": self._task, "seed": seed, "bfcl_id": self._entry["id"],
                                   "user_turns": len(self._entry["question"])}

    def _question(self, turn: int) -> str:
        return "\n\n".join(m["content"] for m in self._entry["question"][turn] if m.get("content"))

    def system_prompt(self) -> str:
        classes = self._entry.get("involved_classes", [])
        about = "\n".join(f"- {self._data.preambles[c]}" for c in classes if self._data.preambles.get(c))
        return (
            "You are an expert in composing functions. You are given a question and a set of possible "
            "functions. Based on the question, you will need to make one or more function/tool calls to "
            "achieve the purpose. If none of the functions can be used, or the question lacks the "
            "parameters a function requires, make no call for it.\n\n"
            'Call a function with a <tool_call>{"name": ..., "arguments": {...}}</tool_call> block; a '
            "reply may hold several. At each turn, try your best to complete the user's current request. "
            f"When you have made every call it needs (or it cannot be done), call {FINISH_TURN}, with no "
            "arguments: the user's next request follows, or the conversation ends."
            + (f"\n\nThe tools:\n{about}" if about else ""))

    def tools(self) -> list[dict[str, Any]]:
        finish = tool_schema(FINISH_TURN, "End your work on the user's current request, once you have made "
                             "every call it needs or when it cannot be done with these functions. The "
                             "user's next request follows, or the conversation ends.")
        return [copy.deepcopy(f.tool) for f in self._available.values()] + [finish]

    def valid_actions(self) -> list[str] | None:
        """A partial list (see the module docstring): ``finish_turn`` and each available function
        with no required argument, called without arguments."""
        if self._done:
            return None
        names = [n for n, f in self._available.items() if not f.required] + [FINISH_TURN]
        return [f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in names]

    # ---- calls

    def call_tool(self, call: ToolCall) -> ToolOutcome:
        if self._done or self._model is None:
            raise ToolError("the conversation has ended")
        if self._finished_at == self.turn:
            raise ToolError(f"{FINISH_TURN} ends the turn: calls after it in the same reply are not run")
        if call.name == FINISH_TURN:
            if call.arguments:
                raise ToolError(f"{FINISH_TURN} takes no arguments")
            return self._finish_turn()
        # every call counts as the turn's response, a refused one too (BFCL's executor answers an
        # unknown name or argument with an error result); only documented functions ever run
        self._turn_calls += 1
        fn = self._callable.get(call.name)
        if fn is None:
            shown = call.name if len(call.name) <= _MAX_NAME_SHOWN else call.name[:_MAX_NAME_SHOWN] + "..."
            self._refuse(f"no function named {shown!r}; the functions are: "
                         + ", ".join(sorted(self._available)) + f", {FINISH_TURN}")
        unknown = [a for a in call.arguments if a not in fn.properties]
        if unknown:
            self._refuse(f"{fn.name} has no parameter {', '.join(repr(a[:_MAX_NAME_SHOWN]) for a in unknown)}; "
                         f"its parameters: {', '.join(fn.properties) or 'none'}")
        missing = sorted(fn.required - set(call.arguments))
        if missing:
            self._refuse(f"{fn.name} needs {', '.join(missing)}")
        for (func, arg), limit in _ARG_LIMITS.items():
            value = call.arguments.get(arg) if func == fn.name else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > limit:
                self._refuse(f"{fn.name}: {arg} must be at most {limit} in magnitude")
        result = self._model.call(fn.name, call.arguments)
        self._model_results.append(result)
        return ToolOutcome(result)

    def _refuse(self, message: str) -> NoReturn:
        """A refused call: its error is among the model's results (as BFCL's executor lists an
        error), and the model reads it."""
        self._model_results.append(f"Error during execution: {message}")
        raise ToolError(message)

    def _finish_turn(self) -> ToolOutcome:
        assert self._model is not None and self._truth is not None
        turn = self._user_turn
        truth = self._data.ground_truth[self._task][turn]
        truth_results = [self._truth.call(name, kwargs) for name, kwargs in truth]
        verdict: bool | None = None
        if truth:  # BFCL judges only turns whose ground truth has calls
            verdict = (self._turn_calls > 0
                       and self._state_checker(self._model.objects, self._truth.objects)["valid"]
                       and self._response_checker(list(self._model_results), truth_results, turn)["valid"])
        self._verdicts.append(verdict)
        self._finished_at = self.turn
        judged = [v for v in self._verdicts if v is not None]
        info = {"bfcl_turn": turn, "bfcl_turn_passed": verdict,
                "bfcl_turns_passed": sum(judged), "bfcl_turns_judged": len(judged)}
        last = turn + 1 == len(self._entry["question"])
        if last or (verdict is False and self.reward_mode == "strict"):
            self._done = True
            total = sum(1 for t in self._data.ground_truth[self._task] if t)
            success = all(judged) and len(judged) == total
            reward = (float(success) if self.reward_mode == "strict"
                      else sum(judged) / max(total, 1))
            text = "The conversation is over." if last else "The conversation is over: this request was not met."
            return ToolOutcome(text, done=True, reward=reward, success=success,
                               info={**info, "bfcl_turns_total": total})
        self._user_turn = turn + 1
        self._turn_calls = 0
        added = self._held_back.get(self._user_turn, [])
        if added:
            self._available.update({n: self._callable[n] for n in added})
            new_tools = json.dumps([self._available[n].tool for n in added], ensure_ascii=False)
            text = f"{new_tools}\n{ADDED_FUNCTIONS_MESSAGE}"
            if q := self._question(self._user_turn):
                text += f"\n\n{q}"
        else:
            text = self._question(self._user_turn)
        return ToolOutcome(text, info={**info, "bfcl_functions_added": list(added)})

    def close(self) -> None:
        self._model = self._truth = None
        self._done = True


__all__ = ["BFCLEnv", "CATEGORIES", "FINISH_TURN", "HELDOUT_EVERY", "NUM_TASKS", "TASKS_PER_CATEGORY",
           "base_task", "bfcl_missing", "category_of", "ground_truth_calls", "is_heldout", "load_data",
           "split_task_ids", "task_id_of"]
