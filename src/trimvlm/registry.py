"""Name -> method-class registries for each axis a recipe can act on (`tokens`, `kv`, `depth`, `router`).
Every module of an axis' package and every installed `trimvlm.methods` entry point is loaded (`load_methods`)
before a method is built or listed.

The one method protocol: a method is a dataclass whose fields are its recipe options, registered here with
`@register(axis, name)`; `check(runner)` refuses a model it cannot run on and `apply(plan, runner)` fills its
axis' part of a `runtime.plan.Plan`. An axis whose method is named by a path (`router=PATH`) registers one class
with `by_path=True`: the recipe's method string is passed as its `path` field."""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import MISSING

from trimvlm.protocol import BY_PATH, REGISTRIES, build, load_methods, register  # noqa: F401  (re-exported)

build_method = build  # the method `axis=method:options` (every method loaded first: `protocol.load_methods`)


def _summary(cls) -> str:
    """First sentence of the method's module docstring (one method per file), else of its class docstring."""
    for doc in (sys.modules[cls.__module__].__doc__, cls.__doc__):
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature is no summary
            first = " ".join(doc.strip().split("\n\n")[0].split())
            return re.split(r"(?<=[^.\s])\.\s", first)[0].rstrip(".") + "."
    return ""


def describe_methods() -> dict[str, list[dict]]:
    """axis -> every registered method: name, summary, options (name, type, default; public fields only)."""
    load_methods()
    out = {}
    for axis, reg in REGISTRIES.items():
        out[axis] = []
        for name in sorted(reg):
            cls = reg[name]
            options = [  # a field without a plain default (none, or a factory) shows None
                {"name": f.name, "type": str(f.type), "default": None if f.default is MISSING else f.default}
                for f in dataclasses.fields(cls)
                if f.init and not f.name.startswith("_")
            ]
            out[axis].append({"name": name, "summary": _summary(cls), "options": options})
    return out
