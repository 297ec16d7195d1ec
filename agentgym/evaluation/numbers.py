"""The one way a run's numbers are written for people: ``agentgym inspect`` and the HTML viewer
(``agentgym view``) both show what ``fmt_num`` returns, so the same value reads the same in both.

The rule: a float is rounded to ``places`` decimals (3 unless told), **half away from zero, on
its shortest decimal form** (Python's ``repr``, the digits JavaScript's ``String(x)`` prints too):
0.8125 -> ``0.813``, 0.0625 -> ``0.063``, -0.0625 -> ``-0.063``, 1.0005 -> ``1.001``. That is
the rounding taught in school, applied to the digits a person would see if the value were
printed whole. Python's ``f"{x:.3f}"`` rounds the exact binary value half to even (0.8125 ->
0.812) and JavaScript's ``toFixed`` rounds the exact binary value half up (0.8125 -> 0.813, but
1.0005 -> 1.000), which is how the two surfaces used to disagree. The viewer does not round in
JavaScript at all: the page embeds the strings this module makes.

Also: integers as they are; ``None``, NaN and infinities as ``-`` (a mean over nothing); a
result that rounds to zero without a sign (``-0.0001`` -> ``0.000``).
"""

from __future__ import annotations

import decimal
import math
from typing import Any

__all__ = ["MISSING", "fmt_num"]

MISSING = "-"

# Enough digits for any double written out in full (the largest has 309 integer digits).
_CONTEXT = decimal.Context(prec=400, rounding=decimal.ROUND_HALF_UP)


def fmt_num(v: Any, places: int = 3) -> str:
    """``v`` as people read it (the module's rule). Booleans and strings come back as ``str(v)``;
    callers that show booleans as yes/no do so before calling."""
    if v is None:
        return MISSING
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return MISSING
        q = decimal.Decimal(repr(v)).quantize(decimal.Decimal(1).scaleb(-places), context=_CONTEXT)
        if q.is_zero():
            q = abs(q)
        return f"{q:f}"
    return str(v)
