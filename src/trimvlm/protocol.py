"""The method registries (ground level: every method package registers itself here, `registry` reads them).

`@register(axis, name)` records a method class under its recipe name; `by_path=True` marks an axis whose method
is named by a path (`router=PATH`). `trimvlm.registry` builds methods from these and lists them.
"""

from __future__ import annotations

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
