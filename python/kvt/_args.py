"""Checks of the int arguments the package takes (ids, counts, ports, sizes): one rule for every
module. An int-like value (an int, a numpy integer, a one-element integer tensor) is taken; a
bool is not (``True`` would read as 1), nor is anything else; a value outside its range is
refused naming the argument, the value and the range. The native layer applies the same rule to
every integer it is given."""

from __future__ import annotations

import operator
from typing import Any

__all__: list[str] = []


def is_bool(value: Any) -> bool:
    """Python's bool, a numpy bool scalar or a torch bool tensor (``__index__`` would turn each
    into 0 or 1)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return False
    return str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def index(value: Any, what: str) -> int:
    """An int from an int-like value; bools and anything else raise TypeError naming ``what``,
    the type and the value."""
    if not is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what}: expected an int, got {type(value).__name__} ({value!r})")


def int_in(value: Any, what: str, lo: int, hi: int, hint: str = "") -> int:
    """:func:`index` of ``value``, in [lo, hi]; ValueError naming ``what``, the value and the
    range (then ``hint``) otherwise."""
    v = index(value, what)
    if not lo <= v <= hi:
        raise ValueError(f"{what} = {v} is out of range [{lo}, {hi}]" + (f": {hint}" if hint
                                                                           else ""))
    return v
