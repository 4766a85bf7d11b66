"""Checks for method options (recipe values arrive from strings, YAML or Python): one message shape everywhere.

A bool is an int in Python; an option meant as a count or a number never accepts one.
"""

from __future__ import annotations

import dataclasses
import functools
import math


def option(default, check, **how):
    """A method option declared with its check: a dataclass field of this default whose value `check_options`
    (run by the axis' base when the method is made) passes to `check(name, value, **how)`, a `require_*` here."""
    return dataclasses.field(default=default, metadata={"check": functools.partial(check, **how)})


def check_options(method) -> None:
    """Run the checks of the method's `option` fields, in field order (ValueError on the first that fails)."""
    for f in dataclasses.fields(method):
        if "check" in f.metadata:
            f.metadata["check"](f.name, getattr(method, f.name))


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


def require_number(name: str, value, low, high=None, *, above=False, below=False, hint: str = "") -> None:
    """ValueError "<name> must be a number in [low, high]<hint>, got <value>" (without `high`: "a finite
    number >= low") unless `value` is a finite number within the bounds (`above` / `below`: strictly above
    `low` / below `high`; the brackets and the sign say which)."""
    ok = is_number(value) and math.isfinite(value) and (value > low if above else value >= low)
    if not (ok and (high is None or (value < high if below else value <= high))):
        if high is None:
            bound = f"finite number {'>' if above else '>='} {low}"
        else:
            bound = f"number in {'(' if above else '['}{low}, {high}{')' if below else ']'}"
        raise ValueError(f"{name} must be a {bound}{hint}, got {value!r}")


def require_choice(name: str, value, allowed) -> None:
    """ValueError "<name> must be one of <allowed>, got <value>" unless `value` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def stage_layers(text, example: str) -> list[int]:
    """A stage list '8-16-24' as [8, 16, 24]: increasing layer numbers >= 1, else a ValueError naming the form."""
    try:
        vals = [int(x) for x in str(text).split("-")]
    except ValueError:
        raise ValueError(f"layers must be layer numbers joined by '-', e.g. {example}; got {text!r}") from None
    if vals != sorted(set(vals)) or vals[0] < 1:
        raise ValueError(f"layers must be increasing layer numbers >= 1, got {text!r}")
    return vals
