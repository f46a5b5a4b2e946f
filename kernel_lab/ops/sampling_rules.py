"""The value rules of the sampling parameters, stated once: `ops.sample` checks its tensors with them,
`SamplingParams` its numbers, and the server's request schema takes its field bounds from BOUNDS."""

from __future__ import annotations

import math
import operator

BOUNDS = {"temperature": {"ge": 0}, "top_k": {"ge": -1}, "top_p": {"gt": 0, "le": 1}}  # pydantic's names
RULES = {
    "temperature": "finite and >= 0 (0 = greedy)",
    "top_k": ">= -1 (0 or -1 = off)",
    "top_p": "in (0, 1] (1 = off)",
}
_COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le}


def satisfies(name: str, value):
    """Whether `value` (a number, or a tensor elementwise) keeps the rule of parameter `name`; never for
    NaN or infinity."""
    ok = abs(value) < math.inf
    for op, bound in BOUNDS[name].items():
        ok = ok & _COMPARE[op](value, bound)
    return ok
