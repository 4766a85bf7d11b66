"""Checks for method options (recipe values arrive from strings, YAML or Python): one message shape everywhere.

A bool is an int in Python; an option meant as a count or a number never accepts one.
"""

from __future__ import annotations


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def require_int(name: str, value, minimum: int | None = None, odd: bool = False, hint: str = "") -> None:
    """ValueError "<name> must be an [odd ]integer[ >= minimum]<hint>, got <value>" unless `value` is one."""
    ok = is_int(value) and (minimum is None or value >= minimum) and (not odd or value % 2 == 1)
    if not ok:
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be an {'odd ' if odd else ''}integer{bound}{hint}, got {value!r}")


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
