"""WebArena's text interface to a web page, shared by the web adapters.

WebArena (and AgentGym's ``agentenv-webarena``, which AgentGym-RL trains with) shows a page as an
*accessibility tree*, one node a line, indented with tabs, each actionable node with a numeric id::

    [1] RootWebArea 'Enter Text Task' focused: True
    \t[5] textbox ''
    \t[6] button 'Submit'

and reads one *id-based action* per reply, inside triple backticks
(``In summary, the next action I will perform is ```click [6]``` ``). This module holds both
halves so that every adapter speaking them agrees:

* :func:`render_accessibility_tree` -- an :class:`AXNode` tree as that text (WebArena's format:
  ``[id] role 'name'`` with ``repr`` quoting, properties as `` key: value``, nameless layout
  nodes such as ``generic`` skipped with their children moved up a level). Used by the MiniWoB++
  adapter (:mod:`env_adapters.miniwob`).
* :func:`extract_web_action` -- the action text in a model reply: the content of the *first*
  fenced block (WebArena's server takes the first), else the ReAct ``Action:`` line this project's
  other adapters read (:func:`env_adapters.parsing.parse_action`).
* :func:`parse_web_action` -- WebArena's id-based action grammar (``browser_env/actions.py``,
  ``create_id_based_action``): ``click [id]``, ``hover [id]``, ``type [id] [text] [0|1]`` (the
  Enter key is pressed after typing unless the flag is ``0``), ``press [key_comb]``,
  ``scroll [up|down]``, ``goto [url]``, ``new_tab``, ``go_back``, ``go_forward``,
  ``tab_focus [n]``, ``close_tab``, ``stop [answer]``; command names are case-sensitive, as
  there. Used by the MiniWoB++ adapter and by the ``webarena`` HTTP client dialect
  (:mod:`env_adapters.http_client`), which refuses locally a reply the WebArena server could not
  parse instead of spending a request on it.

Rendering is not shared with the ``webarena`` dialect: a WebArena server renders its own tree
(from Playwright's Chrome accessibility tree) and parses the raw reply itself; the client only
passes text along.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from env_adapters.parsing import parse_action

#: WebArena's commands (``create_id_based_action``), in the order its prompt lists them.
COMMANDS = ("click", "type", "hover", "press", "scroll", "new_tab", "tab_focus", "close_tab",
            "goto", "go_back", "go_forward", "stop")
#: roles WebArena leaves out of the tree when they have no name (their children move up)
SKIPPED_WHEN_NAMELESS = frozenset({"generic", "img", "list", "strong", "paragraph", "banner",
                                   "navigation", "Section", "LabelText", "Legend", "listitem"})
MAX_NAME_CHARS = 200
_FENCE = re.compile(r"```((?:.|\n)*?)```")


# ------------------------------------------------------------------------------- the tree
@dataclass
class AXNode:
    """One node of an accessibility tree. ``node_id`` is the number actions name (``None``: not
    actionable, e.g. static text); ``props`` are rendered in order as `` key: value``."""

    role: str
    name: str = ""
    node_id: int | None = None
    props: list[tuple[str, object]] = field(default_factory=list)
    children: list["AXNode"] = field(default_factory=list)

    def walk(self) -> list["AXNode"]:
        """This node and its descendants, depth first (document order)."""
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out


def _shown(node: AXNode) -> bool:
    return not (node.role in SKIPPED_WHEN_NAMELESS and not node.name.strip())


def visible_nodes(root: AXNode) -> list[AXNode]:
    """The nodes :func:`render_accessibility_tree` prints, in its order."""
    return [n for n in root.walk() if n is root or _shown(n)]


def render_accessibility_tree(root: AXNode) -> str:
    """``root`` as WebArena's text: one line a node, a tab per level (see the module docstring).
    The root is always printed."""
    lines: list[str] = []

    def visit(node: AXNode, depth: int, is_root: bool = False) -> None:
        shown = is_root or _shown(node)
        if shown:
            name = " ".join(node.name.split())
            if len(name) > MAX_NAME_CHARS:
                name = name[:MAX_NAME_CHARS - 3] + "..."
            head = f"[{node.node_id}] " if node.node_id is not None else ""
            line = f"{head}{node.role} {name!r}"
            for key, value in node.props:
                line += f" {key}: {value!r}" if isinstance(value, str) else f" {key}: {value}"
            lines.append("\t" * depth + line)
        for child in node.children:
            visit(child, depth + 1 if shown else depth)

    visit(root, 0, is_root=True)
    return "\n".join(lines)


# ------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class WebAction:
    """One parsed WebArena id-based action; ``str()`` gives its canonical text (``type`` without
    the flag when Enter is pressed, WebArena's default)."""

    command: str
    element_id: int | None = None
    text: str | None = None  # type: the text; press: the key combination; goto: url; stop: answer
    press_enter: bool = False  # type only
    direction: str | None = None  # scroll only

    def __str__(self) -> str:
        c = self.command
        if c in ("click", "hover"):
            return f"{c} [{self.element_id}]"
        if c == "type":
            return f"type [{self.element_id}] [{self.text}]" + ("" if self.press_enter else " [0]")
        if c == "scroll":
            return f"scroll [{self.direction}]"
        if c == "tab_focus":
            return f"tab_focus [{self.element_id}]"
        if c in ("press", "goto") or (c == "stop" and self.text):
            return f"{c} [{self.text}]"
        return c


def parse_web_action(action_str: str) -> tuple[WebAction | None, str]:
    """``(WebAction, "")`` for a WebArena id-based action, or ``(None, why)``. The grammar and its
    leniencies are WebArena's: the command is the text before the first ``[`` (or the first
    word), arguments are bracketed, ``type`` without a flag presses Enter."""
    s = action_str.strip() if isinstance(action_str, str) else ""
    if not s:
        return None, "the action is empty"
    command = s.split("[")[0].strip() if "[" in s else s.split()[0].strip()
    if command in ("click", "hover"):
        m = re.search(rf"{command} ?\[(\d+)\]", s)
        if not m:
            return None, f"{command} needs an element id: {command} [id]"
        return WebAction(command, element_id=int(m.group(1))), ""
    if command == "type":
        flagged = s if (s.endswith("[0]") or s.endswith("[1]")) else s + " [1]"
        m = re.search(r"type ?\[(\d+)\] ?\[(.+)\] ?\[(\d+)\]", flagged)
        if not m:
            return None, "type needs an element id and a text: type [id] [text] (add [0] to not press Enter)"
        return WebAction("type", element_id=int(m.group(1)), text=m.group(2),
                         press_enter=m.group(3) == "1"), ""
    if command in ("press", "goto"):
        m = re.search(rf"{command} ?\[(.+)\]", s)
        if not m:
            return None, f"{command} needs an argument in brackets: {command} [...]"
        return WebAction(command, text=m.group(1)), ""
    if command == "scroll":
        m = re.search(r"scroll ?\[?(up|down)\]?", s)
        if not m:
            return None, "scroll needs a direction: scroll [up] or scroll [down]"
        return WebAction("scroll", direction=m.group(1)), ""
    if command == "tab_focus":
        m = re.search(r"tab_focus ?\[(\d+)\]", s)
        if not m:
            return None, "tab_focus needs a tab index: tab_focus [n]"
        return WebAction("tab_focus", element_id=int(m.group(1))), ""
    if command in ("new_tab", "close_tab", "go_back", "go_forward"):
        return WebAction(command), ""
    if command == "stop":
        m = re.search(r"stop ?\[(.+)\]", s)
        return WebAction("stop", text=m.group(1) if m else ""), ""
    shown = command if len(command) <= 40 else command[:37] + "..."
    return None, f"unknown command {shown!r}; the commands are {', '.join(COMMANDS)}"


def fenced_action(reply: str) -> str | None:
    """The content of the first triple-backtick block of ``reply`` (WebArena's server's
    ``extract_action``), stripped; ``None`` without one."""
    m = _FENCE.search(reply) if isinstance(reply, str) else None
    return m.group(1).strip() if m else None


def _strip_ticks(line: str) -> str:
    return line.strip().strip("`").strip()


def extract_web_action(reply: str, max_chars: int) -> tuple[str | None, str]:
    """The action text of a model reply: the first fenced block, else the ReAct ``Action:`` line
    (see :func:`env_adapters.parsing.parse_action`; single backticks around it are dropped).
    ``(None, why)`` when there is neither, or the reply is longer than ``max_chars``."""
    if not isinstance(reply, str):
        return None, "the reply is not text"
    if len(reply) > max_chars:
        return None, f"the reply is longer than {max_chars} characters"
    block = fenced_action(reply)
    if block is not None:
        return (block, "") if block else (None, "the ``` block is empty")
    action, why = parse_action(reply, max_chars, _strip_ticks)
    if action is None:
        return None, why.replace('no "Action:" line', 'no action in ``` ``` or on an "Action:" line')
    return action, ""


def parse_web_reply(reply: str, max_chars: int) -> tuple[WebAction | None, str]:
    """:func:`extract_web_action` then :func:`parse_web_action`."""
    text, why = extract_web_action(reply, max_chars)
    if text is None:
        return None, why
    return parse_web_action(text)
