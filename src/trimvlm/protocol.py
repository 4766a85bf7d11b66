"""The method registries (ground level: every method package registers itself here, `registry` reads them).

`@register(axis, name)` records a method class under its recipe name; `by_path=True` marks an axis whose method
is named by a path (`router=PATH`). `build` makes one from its recipe name and options; `trimvlm.registry` loads every method package and lists them.
"""

from __future__ import annotations

import dataclasses

from trimvlm.errors import RecipeError

REGISTRIES: dict[str, dict[str, type]] = {"tokens": {}, "kv": {}, "depth": {}, "router": {}}
BY_PATH: dict[str, type] = {}  # axis -> its one class, for axes whose method is a path


def register(axis: str, name: str, *, by_path: bool = False):
    def deco(cls):
        REGISTRIES[axis][name] = cls
        cls.name = name
        if by_path:
            BY_PATH[axis] = cls
        return cls

    return deco


def build(axis: str, method: str, options: dict):
    """A registered method from its recipe name and options (the packages that register it imported by the
    caller: `trimvlm.registry.build_method` imports them all), every option checked against its fields."""
    reg = REGISTRIES.get(axis)
    if reg is None:
        raise RecipeError(f"unknown recipe axis {axis!r}; allowed: {', '.join(REGISTRIES)}")
    by_path = BY_PATH.get(axis)
    if by_path is None and method not in reg:
        known = ", ".join(sorted(reg)) or "none yet"
        raise RecipeError(f"unknown {axis} method {method!r}; known: {known}")
    cls = by_path or reg[method]
    allowed = {f.name for f in dataclasses.fields(cls) if f.init} - ({"path"} if by_path else set())
    bad = sorted(set(options) - allowed)
    if bad:
        where = f"{axis}=PATH" if by_path else f"{axis} method {method!r}"
        raise RecipeError(f"unknown option(s) {bad} for {where}; allowed: {sorted(allowed)}")
    if by_path:
        options = {"path": str(method)} | dict(options)
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{axis}={method}: {e}") from e
