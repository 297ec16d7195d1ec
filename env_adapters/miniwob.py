"""MiniWoB++ in a real headless browser, with WebArena's observation and action text.

Farama's ``miniwob`` package (PyPI, pinned in pyproject.toml) ships the MiniWoB++ task pages as
HTML files and drives them with Selenium; this adapter uses its Selenium layer
(:class:`miniwob.selenium_instance.SeleniumInstance`: seeding, episode start, the DOM and
utterance read-out, rewards; :mod:`miniwob.selenium_actions`: element clicks, typing, keys,
scrolling) with Debian's ``chromium`` + ``chromium-driver`` (``scripts/setup.sh`` installs them).

* **Tasks.** ``task_id`` picks the family ``families[task_id % len(families)]`` (default
  :data:`FAMILIES`, a fixed list that runs reliably headless) and the instance
  ``task_id // len(families)``; the page's random generator is seeded with
  ``instance + SEED_STRIDE * seed`` (``Math.seedrandom``), so ``reset(task_id, 0)`` is instance
  ``task_id // len(families)`` of its family and no ``(task, seed)`` pair repeats another's page.
  ``task_category`` is the family.
* **Browser.** Each adapter instance starts its own Chromium (its own profile directory) on the
  first ``reset`` and quits it in ``close()``; every ``reset`` loads the task page afresh, so an
  episode never sees the previous one. The page's wall-clock limit (MiniWoB's 10-20 s, which
  would end an episode while a model is still generating) is off by default: ``time_limit_s``
  sets one.
* **Observation.** WebArena's prompt fields with the page as an accessibility tree
  (:func:`env_adapters.web_text.render_accessibility_tree`)::

      OBSERVATION:
      [1] RootWebArea 'Enter Text Task' focused: True
      \t[5] textbox ''
      \t[6] button 'Submit'
      URL: miniwob/enter-text.html
      OBJECTIVE: Enter "Myron" into the text field and press Submit.
      PREVIOUS ACTION: None

  An element's id is MiniWoB's ``ref`` (stable for the whole episode: new elements get new ids,
  none is reused). Roles come from the tag (``button``, ``link``, ``textbox``, ``checkbox``,
  ``radio``, ``LabelText``, ``generic``...); a checkbox or radio inside a ``<label>`` is named by
  the label's text, as a browser's accessibility tree names it; text between elements is
  ``StaticText`` without an id (MiniWoB cannot click a text node).
* **Actions.** WebArena's id-based actions (:func:`env_adapters.web_text.parse_web_action`), in a
  ```` ``` ```` block or on an ``Action:`` line: ``click [id]``; ``type [id] [text]`` (clicks the
  field, types the text, then presses Enter unless the text is followed by ``[0]``);
  ``press [key_comb]`` (``Enter``, ``Tab``, ``Ctrl+a``...); ``scroll [up|down]``. A reply with no
  readable action, or an unknown command, is a format error (``info["format_error"]``); a
  well-formed action this page cannot take (an id not in the observation, typing into a
  button, ``hover``/``goto``/tab commands/``stop``, which MiniWoB++ has no use for) is an invalid
  action (``info["invalid_action"]``, the page unchanged). Either way the turn is consumed.
* **Reward.** MiniWoB's raw reward (without its time penalty) when the page ends the episode,
  clipped to [0, 1]: 1.0 on success (``info["success"]``), 0.0 on failure (MiniWoB's -1).
* ``valid_actions()``: ``click [id]`` for every element with an id in the observation (the
  root page only when there is nothing else), and ``type [id] [value]`` for every text field
  and every value of MiniWoB's own field extractor for the task (the quoted words of the
  instruction, ``miniwob.fields``: what Liu et al. 2018's ``FOCUS_ELEMENT_AND_TYPE_FIELD`` types).
  Tasks without fields list clicks only. ``press`` and ``scroll`` are never listed.

A browser that crashes, hangs or cannot start raises :class:`InfraError`; a missing
``chromium``/``chromedriver`` is a :class:`RuntimeError` at construction naming the fix.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from typing import Any

from env_adapters.base import InfraError, StepResult, TextEnv, format_error, utf8_safe
from env_adapters.web_text import AXNode, WebAction, parse_web_reply, render_accessibility_tree, visible_nodes

#: Task families served by default: element clicks, checkboxes, radios, text entry. Each was run
#: headless with the scripted expert on many seeds (tests/env_adapters/test_miniwob.py).
FAMILIES: tuple[str, ...] = (
    "click-test", "click-test-2", "click-button", "click-button-sequence", "click-link",
    "click-dialog", "click-dialog-2", "click-tab", "click-collapsible", "click-checkboxes",
    "click-option", "focus-text", "focus-text-2", "enter-text", "enter-text-2", "enter-password",
    "login-user",
)
SEED_STRIDE = 1_000_000
MAX_REPLY_CHARS = 4000
MAX_TYPE_CHARS = 256
#: setTimeout's largest delay (ms); MiniWoB's timer with it never fires within a run
NO_TIME_LIMIT_MS = 2**31 - 1
#: Chromium's switches: headless, no sandbox (containers run as root), no GPU, no /dev/shm
#: (small in containers), nothing that phones home or pops up.
CHROMIUM_ARGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-extensions", "--no-first-run", "--no-default-browser-check", "--mute-audio",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--password-store=basic", "--use-mock-keychain",
)
_BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome")
_DRIVER_NAMES = ("chromedriver",)
_TEXT_INPUTS = {"input_text", "input_password", "input_email", "input_search", "input_tel",
                "input_url", "input_number", "textarea"}
#: roles a browser names by their content when the element has no text of its own
_NAME_FROM_CONTENT = {"button", "link", "heading", "option", "cell", "columnheader"}
_ROLES = {
    "a": "link", "button": "button", "input_button": "button", "input_submit": "button",
    "input_reset": "button", "input_checkbox": "checkbox", "input_radio": "radio",
    "select": "combobox", "option": "option", "label": "LabelText", "p": "paragraph",
    "ul": "list", "ol": "list", "li": "listitem", "img": "img", "table": "table", "tr": "row",
    "td": "cell", "th": "columnheader", "form": "form", "input_range": "slider",
    "h1": "heading", "h2": "heading", "h3": "heading", "h4": "heading", "h5": "heading",
    "h6": "heading", "div": "generic", "span": "generic", "t": "StaticText", "b": "strong",
    "strong": "strong", "i": "emphasis", "em": "emphasis", "svg": "graphics-document",
    **{t: "textbox" for t in _TEXT_INPUTS},
}

SYSTEM_PROMPT = (
    "You are an autonomous agent operating a web browser. Each turn you see the user's objective "
    "and the current page as an accessibility tree: one element a line, actionable elements "
    "with a numeric id in brackets, e.g. [12] button 'Submit'.\n\n"
    "Actions:\n"
    "click [id]: click the element with that id.\n"
    "type [id] [text]: click the text field with that id and type the text; Enter is pressed "
    "afterwards unless you end with [0], e.g. type [5] [hello] [0].\n"
    "press [key_comb]: press a key or combination, e.g. press [Enter], press [Ctrl+a].\n"
    "scroll [up] or scroll [down]: scroll the page.\n\n"
    "Issue exactly one action per reply. Think step by step, then write the action inside triple "
    "backticks, e.g. \"In summary, the next action I will perform is ```click [12]```\" "
    "(a final line \"Action: click [12]\" is read as well). The episode ends when the task is "
    "done or failed."
)


def _role(tag: str) -> str:
    return _ROLES.get(tag, tag.split("_")[0])


def find_chromium(binary: str | None = None, driver: str | None = None) -> tuple[str | None, str | None]:
    """The Chromium binary and chromedriver to use: the arguments, else ``MINIWOB_CHROME_BINARY`` /
    ``MINIWOB_CHROMEDRIVER`` (the miniwob package's variables), else the first on ``PATH``."""
    binary = binary or os.environ.get("MINIWOB_CHROME_BINARY") or next(
        filter(None, (shutil.which(n) for n in _BROWSER_NAMES)), None)
    driver = driver or os.environ.get("MINIWOB_CHROMEDRIVER") or next(
        filter(None, (shutil.which(n) for n in _DRIVER_NAMES)), None)
    runnable = [p if p and os.path.isfile(p) and os.access(p, os.X_OK) else None for p in (binary, driver)]
    return runnable[0], runnable[1]


def chromium_missing(binary: str | None = None, driver: str | None = None) -> str | None:
    """Why MiniWoB++ cannot run here (``None`` when it can): for tests to skip with."""
    try:
        import miniwob  # noqa: F401
    except ImportError:
        return "the miniwob package is not installed (pip install -e . / scripts/setup.sh)"
    b, d = find_chromium(binary, driver)
    if not b or not d:
        missing = " and ".join(n for n, p in (("chromium", b), ("chromedriver", d)) if not p)
        return (f"{missing} not found: install Debian's chromium and chromium-driver "
                "(scripts/setup.sh does, where apt-get is available) or set "
                "MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER")
    return None


def parse_reply(reply: str, max_chars: int = MAX_REPLY_CHARS) -> tuple[str | None, str]:
    """The canonical text of the action in ``reply`` (``click [4]``), or ``(None, why)``."""
    action, why = parse_web_reply(reply, max_chars)
    return (str(action), "") if action is not None else (None, why)


def family_of(task_id: int, families: tuple[str, ...] = FAMILIES) -> tuple[str, int]:
    """``(family, instance)`` of ``task_id``."""
    return families[int(task_id) % len(families)], int(task_id) // len(families)


@functools.cache
def _browser_class() -> Any:
    """:class:`SeleniumInstance` with this adapter's Chromium and one page per family."""
    from miniwob.fields import get_field_extractor
    from miniwob.selenium_instance import SeleniumInstance
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    class Browser(SeleniumInstance):
        def __init__(self, binary: str, driver: str, data_mode: str, load_timeout_s: float):
            super().__init__(index=0, subdomain=FAMILIES[0], headless=True, data_mode=data_mode)
            self.record_screenshots = False
            self.binary, self.driver_path, self.load_timeout_s = binary, driver, load_timeout_s
            self.profile = tempfile.mkdtemp(prefix="agentgym-miniwob-")

        def create_driver(self) -> None:  # Debian's Chromium, a private profile
            options = webdriver.ChromeOptions()
            options.binary_location = self.binary
            for arg in CHROMIUM_ARGS:
                options.add_argument(arg)
            options.add_argument(f"--window-size={self.window_width},{self.window_height}")
            options.add_argument(f"--user-data-dir={self.profile}")
            self.driver = webdriver.Chrome(service=Service(executable_path=self.driver_path),
                                           options=options)
            self.driver.set_page_load_timeout(self.load_timeout_s)
            self.driver.set_script_timeout(self.load_timeout_s)

        def open(self, family: str, time_limit_ms: int) -> None:
            """Load ``family``'s page afresh and wait for its start screen."""
            from miniwob.selenium_instance import DEFAULT_BASE_URL

            self.url = f"{DEFAULT_BASE_URL}{family}.html"
            self.field_extractor = get_field_extractor(family)
            self.driver.get(self.url)
            deadline = time.monotonic() + self.load_timeout_s
            while not self.driver.execute_script(
                    "return typeof core !== 'undefined' && !!document.getElementById('sync-task-cover');"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{family}: the page did not load in {self.load_timeout_s} s")
                time.sleep(0.02)
            self.driver.execute_script(f"core.EPISODE_MAX_TIME = {int(time_limit_ms)};")

    return Browser


class MiniWoBEnv(TextEnv):
    """One MiniWoB++ episode at a time in this instance's own headless Chromium."""

    name = "miniwob"

    @classmethod
    def task_category(cls, task_id: int) -> str:
        """The task family (``click-button``, ``enter-text``...)."""
        return family_of(task_id)[0]

    def __init__(self, families: list[str] | tuple[str, ...] | None = None,
                 time_limit_s: float | None = None, data_mode: str = "train",
                 max_reply_chars: int = MAX_REPLY_CHARS, chromium: str | None = None,
                 chromedriver: str | None = None, load_timeout_s: float = 30.0,
                 settle_timeout_s: float = 2.0) -> None:
        self.families = tuple(families) if families else FAMILIES
        from miniwob.fields import FIELD_EXTRACTORS

        unknown = [f for f in self.families if f not in FIELD_EXTRACTORS or f.startswith("flight.")]
        if unknown:
            raise ValueError(f"unknown MiniWoB++ task families {unknown} (envs[].kwargs.families); "
                             f"the default list is {list(FAMILIES)}")
        if time_limit_s is not None and not 0 < time_limit_s * 1000 < NO_TIME_LIMIT_MS:
            raise ValueError("time_limit_s must be > 0 and below 24 days, or None (no limit)")
        why = chromium_missing(chromium, chromedriver)
        if why:
            raise RuntimeError(f"miniwob: {why}")
        self.chromium, self.chromedriver = find_chromium(chromium, chromedriver)
        self.time_limit_ms = NO_TIME_LIMIT_MS if time_limit_s is None else int(time_limit_s * 1000)
        self.data_mode = data_mode
        self.max_reply_chars = int(max_reply_chars)
        self.load_timeout_s = float(load_timeout_s)
        self.settle_timeout_s = float(settle_timeout_s)
        self._browser: Any = None
        self._procs: list[Any] = []  # psutil.Process of chromedriver and Chromium
        self._closed = False
        self._live = False
        self._done = False
        self.success = False
        self._previous = "None"
        self._last_observation = ""
        self.task: dict[str, Any] = {}

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    # ------------------------------------------------------------------ browser
    def _start_browser(self) -> None:
        try:
            self._browser = _browser_class()(self.chromium, self.chromedriver, self.data_mode,
                                              self.load_timeout_s)
            self._browser.create_driver()
        except Exception as e:  # noqa: BLE001 - a browser that cannot start is an infra fault
            self._quit()
            raise InfraError(f"miniwob: Chromium did not start ({type(e).__name__}: {e})") from e
        self._track()

    @staticmethod
    def _process_tree(browser: Any) -> list[Any]:
        """chromedriver's process and its descendants (Chromium's), as ``psutil.Process``es (they
        remember their start time, so a reused pid is never mistaken for one of them)."""
        try:
            import psutil

            root = psutil.Process(browser.driver.service.process.pid)
            return [root] + root.children(recursive=True)
        except Exception:  # noqa: BLE001 - accounting only
            return []

    def _track(self) -> list[Any]:
        """The running processes of this instance's browser (those seen before included: one
        that left the tree is still ours)."""
        if self._browser is not None:
            known = {p.pid for p in self._procs}
            self._procs += [p for p in self._process_tree(self._browser) if p.pid not in known]
        self._procs = [p for p in self._procs if _running(p)]
        return self._procs

    def browser_pids(self) -> list[int]:
        """The running processes this instance started (chromedriver, Chromium's), for leak checks."""
        return sorted(p.pid for p in self._track())

    def _quit(self) -> None:
        """Quit the browser, remove its profile, end any of its processes still running."""
        procs = self._track()
        browser, self._browser, self._procs = self._browser, None, []
        if browser is not None:
            if getattr(browser, "driver", None) is not None:
                try:
                    browser.driver.quit()
                except Exception:  # noqa: BLE001 - the processes are reaped below either way
                    pass
            shutil.rmtree(getattr(browser, "profile", ""), ignore_errors=True)
        _reap(procs)

    def _call(self, what: str, fn, *args: Any) -> Any:
        """A browser call; a crashed, hung or vanished browser is an :class:`InfraError`."""
        try:
            return fn(*args)
        except InfraError:
            raise
        except Exception as e:  # noqa: BLE001 - selenium's WebDriverException and kin
            raise InfraError(f"miniwob: {what} failed ({type(e).__name__}: {str(e)[:300]})") from e

    def _settle(self) -> None:
        """Wait (up to ``settle_timeout_s``) for jQuery animations the action started, so that the
        observation does not depend on timing."""
        driver = self._browser.driver
        deadline = time.monotonic() + self.settle_timeout_s
        while driver.execute_script(
                "return typeof jQuery !== 'undefined' && jQuery(':animated').length > 0;"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)

    # ------------------------------------------------------------------ reset
    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if task_id < 0 or seed < 0:
            raise ValueError("task_id and seed must be >= 0")
        if self._closed:
            raise RuntimeError("environment is closed")
        family, instance = family_of(task_id, self.families)
        page_seed = instance + SEED_STRIDE * int(seed)
        if self._browser is None:
            self._start_browser()

        def start() -> Any:
            b = self._browser
            b.open(family, self.time_limit_ms)
            b.begin_task(seed=page_seed)
            title = b.driver.execute_script("return document.title;") or family
            obs, _ = b.get_observation(use_cached_fields=False)
            return title, obs

        self._live = False
        title, obs = self._call(f"reset to {family} seed {page_seed}", start)
        self.title = str(title)
        self.family = family
        self.fields = [(str(k), str(v)) for k, v in obs["fields"]]
        self.utterance = obs["utterance"]
        self.task = {"task_id": int(task_id), "seed": int(seed), "family": family,
                     "page_seed": page_seed, "utterance": self.utterance}
        self._done = False
        self.success = False
        self._live = True
        self._read_page(obs)
        return self._observation("None"), {**self.task, "success": False}

    # ------------------------------------------------------------------ page -> text
    def _read_page(self, obs: dict[str, Any]) -> None:
        """Build the tree of the observation ``obs`` (miniwob's), keep its elements by id."""
        elements = obs["dom_elements"]
        by_ref = {int(e["ref"]): e for e in elements}
        kids: dict[int, list[dict]] = {}
        for e in elements:
            kids.setdefault(int(e["parent"]), []).append(e)
        root_el = next(e for e in elements if int(e["parent"]) == 0)
        self.elements = by_ref

        def content(e: dict) -> str:
            """The text inside ``e`` (a browser names buttons and links by it)."""
            return " ".join(filter(None, [str(e["text"])] + [content(c) for c in kids.get(int(e["ref"]), [])]))

        def node(e: dict) -> AXNode:
            ref, tag = int(e["ref"]), str(e["tag"]).lower()
            role = "RootWebArea" if e is root_el else _role(tag)
            children = kids.get(ref, [])
            name = str(e["text"])
            props: list[tuple[str, object]] = []
            if tag in ("input_checkbox", "input_radio"):
                parent = by_ref.get(int(e["parent"]))
                if parent is not None and str(parent["tag"]).lower() == "label":
                    name = " ".join(str(s["text"]) for s in kids.get(int(parent["ref"]), [])
                                    if str(s["tag"]).lower() == "t")
                props.append(("checked", str(e["value"]) == "True"))
            if e is root_el:
                name = self.title
            elif not name and role in _NAME_FROM_CONTENT:
                name = content(e)
            flags = e["flags"]
            if bool(flags[0]):  # focused
                props.insert(0, ("focused", True))
            if tag in _TEXT_INPUTS:
                name = ""
                if str(e["value"]):
                    props.append(("value", str(e["value"])))
            return AXNode(role, name, None if tag == "t" else ref, props, merged([node(c) for c in children]))

        def merged(nodes: list[AXNode]) -> list[AXNode]:
            """Adjacent text pieces as one ``StaticText``: MiniWoB cuts a text node at every line
            wrap (so at font-dependent places); a browser's tree has one node per text."""
            out: list[AXNode] = []
            for n in nodes:
                if out and n.role == "StaticText" and out[-1].role == "StaticText":
                    out[-1] = AXNode("StaticText", f"{out[-1].name} {n.name}")
                else:
                    out.append(n)
            return out

        self.tree = node(root_el)
        self.shown = visible_nodes(self.tree)
        self.page_text = render_accessibility_tree(self.tree)

    def _observation(self, previous: str) -> str:
        self._previous = previous
        return (f"OBSERVATION:\n{self.page_text}\nURL: miniwob/{self.family}.html\n"
                f"OBJECTIVE: {self.utterance}\nPREVIOUS ACTION: {previous}")

    def observe(self) -> str:
        """The current page read afresh from the browser, as the last observation showed it (the
        same ``PREVIOUS ACTION``); for checks that nothing else changed this instance's page."""
        if not self._live:
            raise RuntimeError("call reset() before observe()")
        if self._done:
            return self._last_observation
        obs, _ = self._call("observe", self._browser.get_observation, True)
        self._read_page(obs)
        return self._observation(self._previous)

    def _shown_ids(self) -> dict[int, AXNode]:
        return {n.node_id: n for n in self.shown if n.node_id is not None}

    def valid_actions(self) -> list[str] | None:
        if not self._live or self._done:
            return None if not self._live else []
        ids = self._shown_ids()
        root_id = self.tree.node_id
        clicks = [f"click [{i}]" for i in ids if i != root_id] or [f"click [{root_id}]"]
        values = list(dict.fromkeys(v for _, v in self.fields if v))
        types = [f"type [{i}] [{v}]" for i, n in ids.items() if n.role == "textbox" for v in values]
        return clicks + types

    # ------------------------------------------------------------------ step
    def step(self, action_text: str) -> StepResult:
        if self._closed:
            raise RuntimeError("environment is closed")
        if not self._live:
            raise RuntimeError("call reset() before step()")
        base = {**self.task, "success": False, "format_error": False, "invalid_action": False,
                "parsed_action": None}
        if self._done:
            return StepResult("The episode is over.", 0.0, True, False, {**base, "success": self.success})
        # lone surrogates (invalid UTF-8 from a tokenizer) cannot travel to the browser: U+FFFD
        reply = utf8_safe(action_text) if isinstance(action_text, str) else action_text
        action, why = parse_web_reply(reply, self.max_reply_chars)
        if action is None:
            return format_error(
                f"Invalid action: {why}. Write one action inside triple backticks, e.g. "
                f"```click [12]```.\n\n" + self._observation("None (invalid)"),
                **{**base, "format_error": True})
        base["parsed_action"] = str(action)
        problem = self._check(action)
        if problem:
            return StepResult(self._observation(f"{action} (failed: {problem})"), 0.0, False, False,
                              {**base, "invalid_action": True})
        meta = self._call(f"action {action}", self._perform, action)
        if meta["done"]:
            raw = float(meta["raw_reward"] or 0.0)
            self._done = True
            self.success = raw >= 1.0
            reward = min(1.0, max(0.0, raw))
            verdict = "completed" if self.success else "not completed"
            obs = (f"The episode is over: the task was {verdict} (MiniWoB++ reward {raw:+.2f}).\n"
                   f"OBJECTIVE: {self.utterance}\nPREVIOUS ACTION: {action}")
            self._last_observation = obs
            return StepResult(obs, reward, True, False,
                              {**base, "success": self.success, "raw_reward": raw,
                               "reason": None if meta.get("reason") is None else str(meta["reason"])})
        return StepResult(self._observation(str(action)), 0.0, False, False, base)

    def _check(self, action: WebAction) -> str:
        """Why ``action`` cannot be taken on this page (``""``: it can)."""
        c = action.command
        if c in ("click", "type"):
            node = self._shown_ids().get(action.element_id if action.element_id is not None else -1)
            if node is None:
                return f"there is no element [{action.element_id}] on the page"
            if c == "type":
                if node.role != "textbox":
                    return f"[{action.element_id}] is a {node.role}, not a text field"
                if len(action.text or "") > MAX_TYPE_CHARS:
                    return f"the text is longer than {MAX_TYPE_CHARS} characters"
            return ""
        if c == "press":
            return "" if _miniwob_key(action.text or "") else f"unknown key combination {action.text!r}"
        if c == "scroll":
            return ""
        return f"{c} is not available in MiniWoB++ (one page, no tabs; the page ends the episode itself)"

    def _perform(self, action: WebAction) -> dict[str, Any]:
        from miniwob.selenium_actions import (
            execute_click_element, execute_press_key, execute_scroll_coords, execute_type_text)

        b = self._browser
        d = b.driver
        if action.command == "click":
            execute_click_element(action.element_id, d)
        elif action.command == "type":
            execute_click_element(action.element_id, d)
            if not b.get_metadata()["done"] and action.text:
                execute_type_text(action.text, d)
            if action.press_enter and not b.get_metadata()["done"]:
                execute_press_key("<Enter>", d)
        elif action.command == "press":
            execute_press_key(_miniwob_key(action.text or ""), d)
        elif action.command == "scroll":
            amount = 100 if action.direction == "down" else -100
            execute_scroll_coords(b.task_width / 2, b.task_height / 2, amount, 0, d)
        meta = b.get_metadata()
        if not meta["done"]:
            self._settle()
            meta = b.get_metadata()
        if not meta["done"]:
            obs, _ = b.get_observation(use_cached_fields=True)
            self._read_page(obs)
        return meta

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        self._closed = True
        self._live = False
        self._quit()


def _running(proc: Any) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(procs: list[Any], timeout_s: float = 3.0) -> None:
    """End what is left of ``procs`` (processes this adapter started, and only those): wait up
    to ``timeout_s`` for them to exit after the driver's quit, then kill the rest."""
    import psutil

    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _running(p)]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


_KEY_NAMES = {"ctrl": "C-", "control": "C-", "alt": "A-", "option": "A-", "shift": "S-",
              "meta": "M-", "cmd": "M-", "command": "M-"}
_KEY_ALIASES = {"esc": "Escape", "return": "Enter", "space": "Space", "del": "Delete",
                "up": "ArrowUp", "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight",
                "pageup": "PageUp", "pagedown": "PageDown", "backspace": "Backspace"}


def _miniwob_key(key_comb: str) -> str | None:
    """WebArena's key combination (``Ctrl+a``, ``Enter``, ``Shift+Tab``) in miniwob's syntax
    (``C-a``, ``<Enter>``), or ``None`` if it names no key."""
    from miniwob.constants import WEBDRIVER_SPECIAL_KEYS

    parts = [p.strip() for p in key_comb.strip().split("+")]
    if not parts or not parts[-1] or len(parts) > 4:
        return None
    mods = []
    for p in parts[:-1]:
        if p.lower() not in _KEY_NAMES:
            return None
        mods.append(_KEY_NAMES[p.lower()])
    key = parts[-1]
    if len(key) == 1 and 32 <= ord(key) < 127:
        return "".join(mods) + key
    special = {k[1:-1].lower(): k for k in WEBDRIVER_SPECIAL_KEYS}
    name = _KEY_ALIASES.get(key.lower(), key).lower()
    return "".join(mods) + special[name] if name in special else None
