"""A MiniWoB++ expert: one rule per task family over the adapter's page (privileged).

It reads what the adapter read from the page -- the accessibility-tree nodes it shows
(``env.shown``), MiniWoB's element records behind them (``env.elements``: HTML ``id``, classes,
``tampered`` flag, values) and the fields MiniWoB's extractor took from the instruction
(``env.fields``) -- and plans from the *current* page every turn, so a turn that was not its own
(a DART noise action) is repaired where it can be: a box checked by mistake is unchecked, a text
field holding the wrong text is emptied (``press [Backspace]``, one character a turn) and
retyped.

Families: every one of :data:`env_adapters.miniwob.FAMILIES`, plus ``enter-text-2`` (the text
in the case the instruction asks for) and ``click-collapsible`` (open the section, then submit).
Any other family: ``None`` (the expert gives up). Measured success: tests/env_adapters/
test_miniwob.py and docs/results.md.
"""

from __future__ import annotations

import re
from typing import Any

from env_adapters.base import TextEnv
from env_adapters.experts.base import Expert

_ORDINALS = {"1st": 0, "2nd": 1, "3rd": 2, "4th": 3, "5th": 4}


class MiniWoBExpert(Expert):
    def reset(self, env: TextEnv, observation: str, info: dict[str, Any]) -> None:
        self.env: Any = env

    # -------------------------------------------------------------- page helpers
    def _nodes(self, role: str | None = None) -> list:
        return [n for n in self.env.shown if n.node_id is not None and n.node_id != self.env.tree.node_id
                and (role is None or n.role == role)]

    def _el(self, node: Any) -> dict[str, Any]:
        return self.env.elements[node.node_id]

    def _field(self, key: str) -> str:
        return next((v for k, v in self.env.fields if k == key), "")

    def _named(self, name: str, role: str | None = None) -> Any:
        return next((n for n in self._nodes(role) if n.name == name), None)

    @staticmethod
    def _checked(node: Any) -> bool:
        return dict(node.props).get("checked") is True

    def _submit(self, name: str = "Submit") -> str | None:
        n = next((n for n in self._nodes("button") if n.name.lower() == name.lower()), None)
        return f"click [{n.node_id}]" if n else None

    def _fill(self, node: Any, text: str) -> str | None:
        """The next action that makes ``node``'s value ``text``; ``None`` when it already is."""
        value = str(self._el(node)["value"])
        if value == text:
            return None
        if value:  # someone else's text: delete it from the end, then type
            if not bool(self._el(node)["flags"][0]):  # not focused
                return f"click [{node.node_id}]"
            return "press [Backspace]"
        return f"type [{node.node_id}] [{text}] [0]"

    # -------------------------------------------------------------- the rules
    def act(self, observation: str) -> str | None:
        rule = getattr(self, "_" + self.env.family.replace("-", "_"), None)
        return rule() if rule else None

    def _click_test(self) -> str | None:
        buttons = self._nodes("button")
        return f"click [{buttons[0].node_id}]" if buttons else None

    def _click_named(self, role: str | None = "button") -> str | None:
        n = self._named(self._field("target"), role)
        return f"click [{n.node_id}]" if n else None

    _click_test_2 = _click_named
    _click_button = _click_named

    def _click_link(self) -> str | None:
        return self._click_named(None)

    def _click_button_sequence(self) -> str | None:
        one, two = self._named("ONE", "button"), self._named("TWO", "button")
        if one is None or two is None:
            return None
        return f"click [{(two if self._el(one)['flags'][1] else one).node_id}]"  # flags[1]: tampered

    def _close_button(self) -> Any:
        return next((n for n in self._nodes("button")
                     if "ui-dialog-titlebar-close" in str(self._el(n)["classes"])), None)

    def _click_dialog(self) -> str | None:
        n = self._close_button()
        return f"click [{n.node_id}]" if n else None

    def _click_dialog_2(self) -> str | None:
        target = self._field("target")
        n = self._close_button() if target == "x" else self._named(target, "button")
        return f"click [{n.node_id}]" if n else None

    def _click_tab(self) -> str | None:
        n = self._named(f"Tab #{self._field('target')}", "link")
        return f"click [{n.node_id}]" if n else None

    def _click_checkboxes(self) -> str | None:
        wanted = {v for k, v in self.env.fields if k.startswith("target")}
        for n in self._nodes("checkbox"):
            if self._checked(n) != (n.name in wanted):
                return f"click [{n.node_id}]"
        return self._submit()

    def _click_option(self) -> str | None:
        n = self._named(self._field("target"), "radio")
        if n is None:
            return None
        return self._submit() if self._checked(n) else f"click [{n.node_id}]"

    def _focus_text(self) -> str | None:
        boxes = self._nodes("textbox")
        return f"click [{boxes[0].node_id}]" if boxes else None

    def _focus_text_2(self) -> str | None:
        boxes = self._nodes("textbox")
        m = re.search(r"the (\d+)(?:st|nd|rd|th) input", self.env.utterance)
        i = int(m.group(1)) - 1 if m else -1
        return f"click [{boxes[i].node_id}]" if 0 <= i < len(boxes) else None

    def _fill_then_submit(self, texts: list[tuple[Any, str]], submit: str = "Submit") -> str | None:
        for node, text in texts:
            if node is None:
                return None
            action = self._fill(node, text)
            if action:
                return action
        return self._submit(submit)

    def _enter_text(self) -> str | None:
        boxes = self._nodes("textbox")
        return self._fill_then_submit([(boxes[0] if boxes else None, self._field("target"))])

    def _enter_text_2(self) -> str | None:
        boxes = self._nodes("textbox")
        text = self._field("text")
        text = text.upper() if self._field("case") == "upper" else text.lower()
        return self._fill_then_submit([(boxes[0] if boxes else None, text)])

    def _enter_password(self) -> str | None:
        boxes = self._nodes("textbox")
        if len(boxes) != 2:
            return None
        return self._fill_then_submit([(b, self._field("target")) for b in boxes])

    def _login_user(self) -> str | None:
        by_id = {self._el(n)["id"]: n for n in self._nodes("textbox")}
        return self._fill_then_submit([(by_id.get("username"), self._field("username")),
                                       (by_id.get("password"), self._field("password"))], "Login")

    def _click_collapsible(self) -> str | None:
        header = next((n for n in self._nodes("heading")), None)
        if header is None:
            return None
        if "ui-state-active" not in str(self._el(header)["classes"]):
            return f"click [{header.node_id}]"
        return self._submit()
