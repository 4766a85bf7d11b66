"""Name -> method-class registries for each axis a recipe can act on (`tokens`, `kv`, `depth`)."""

from __future__ import annotations

import dataclasses

from trimvlm.errors import RecipeError

REGISTRIES: dict[str, dict[str, type]] = {"tokens": {}, "kv": {}, "depth": {}}


def register(axis: str, name: str):
    def deco(cls):
        REGISTRIES[axis][name] = cls
        cls.name = name
        return cls

    return deco


def _load_methods() -> None:
    # importing the packages registers their methods
    import trimvlm.depth  # noqa: F401
    import trimvlm.kv  # noqa: F401
    import trimvlm.tokens  # noqa: F401


def build_method(axis: str, method: str, options: dict):
    _load_methods()
    reg = REGISTRIES.get(axis)
    if reg is None:
        raise RecipeError(f"unknown recipe axis {axis!r}; allowed: {', '.join(REGISTRIES)}")
    if method not in reg:
        known = ", ".join(sorted(reg)) or "none yet"
        raise RecipeError(f"unknown {axis} method {method!r}; known: {known}")
    cls = reg[method]
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    bad = sorted(set(options) - allowed)
    if bad:
        raise RecipeError(f"unknown option(s) {bad} for {axis} method {method!r}; allowed: {sorted(allowed)}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{axis}={method}: {e}") from e
