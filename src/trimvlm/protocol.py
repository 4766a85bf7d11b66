"""The method registries (ground level: every method package registers itself here, `registry` reads them).

`@register(axis, name)` records a method class under its recipe name; `by_path=True` marks an axis whose method
is named by a path (`router=PATH`). `build` makes one from its recipe name and options.

Where methods come from (`load_methods`): every module of an axis' package (`trimvlm.tokens`, `trimvlm.kv`,
`trimvlm.depth`, `trimvlm.router`), found on disk by `discover`, so a new file with `@register` is a method
without any import list; then the installed packages' entry points of group `trimvlm.methods`, each naming a
module to import or a callable to call, loaded once per process when a method is first looked up.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
import types
from importlib.metadata import EntryPoint, entry_points
from typing import ClassVar

from trimvlm.errors import PluginError, RecipeError


@dataclasses.dataclass
class Method:
    """Base of every registered method, whatever its axis (tokens/base.py `TokenReducer`, kv/base.py `KVPolicy`,
    depth/base.py `DepthMethod`, the router): its dataclass fields are its recipe options.

    name: the recipe name (`register` sets it); excludes: the other axes whose choice this method makes itself
    (a recipe naming both is refused); predictable: whether `trimvlm tune` may predict its costs from the shapes
    alone (a method whose counts or budgets follow the data says False, as a class value or a property).

    Each axis asks one hook of a method (tokens: `choose(view)`, kv: `scores(view)`, depth: `skipped(runner)`)
    and reads what else it needs from declarations on the class; the axis' base implements `check` and
    `apply`."""

    name: ClassVar[str] = "?"
    excludes: ClassVar[tuple[str, ...]] = ()
    predictable: ClassVar[bool] = True

    def check(self, runner) -> None:
        """Raise RecipeError when the options do not fit this model (nothing to check by default)."""

    def apply(self, plan, runner) -> None:  # pragma: no cover - every axis' base implements it
        """Fill this axis' part of `plan` (a `runtime.plan.Plan`)."""
        raise NotImplementedError


REGISTRIES: dict[str, dict[str, type]] = {"tokens": {}, "kv": {}, "depth": {}, "router": {}}
BY_PATH: dict[str, type] = {}  # axis -> its one class, for axes whose method is a path


ENTRY_POINT_GROUP = "trimvlm.methods"
_loaded = False  # every axis package discovered and every entry point loaded, once per process
_plugins: set[tuple[str, str]] = set()  # (name, value) of each entry point loaded
_loading = threading.RLock()  # two threads' first look-ups load once


def register(axis: str, name: str, *, by_path: bool = False):
    def deco(cls):
        old = REGISTRIES[axis].get(name)
        if old is not None and _where(old) != _where(cls):
            raise RecipeError(f"{axis} method {name!r} is registered twice, by {_where(old)} and {_where(cls)}; "
                              "a method name must be unique within its axis")  # fmt: skip
        REGISTRIES[axis][name] = cls
        cls.name = name
        if by_path:
            BY_PATH[axis] = cls
        return cls

    return deco


def _where(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def discover(package: str) -> None:
    """Import every module of `package` and of its subpackages, found on disk by pkgutil (no list kept by hand),
    so each registers the methods it defines. An import error propagates: nothing is skipped."""
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        importlib.import_module(info.name)


def load_methods() -> None:
    """Register every method: each axis' package (`trimvlm.<axis>`, every module in it), then the entry points of
    group `trimvlm.methods` of the installed packages. Done once per process; a plugin that fails to load raises
    a one-line PluginError naming it (and is tried again on the next call)."""
    global _loaded
    if _loaded:
        return
    with _loading:
        if _loaded:  # loaded by another thread meanwhile
            return
        for axis in REGISTRIES:
            discover(f"trimvlm.{axis}")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) not in _plugins:
                _load_plugin(ep)
                _plugins.add((ep.name, ep.value))
        _loaded = True


def _load_plugin(ep: EntryPoint) -> None:
    """Import the entry point's module, or call the callable it names (which registers its methods)."""
    try:
        target = ep.load()
        if callable(target) and not isinstance(target, types.ModuleType):
            target()
    except Exception as e:  # any failure of someone else's package: one line that names it
        dist = f" (package {ep.dist.name})" if ep.dist is not None else ""
        raise PluginError(
            f"method plugin {ep.name!r}{dist} of entry-point group {ENTRY_POINT_GROUP} failed to load "
            f"{ep.value}: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from e


def build(axis: str, method: str, options: dict):
    """A registered method from its recipe name and options (every method loaded first, `load_methods`), every
    option checked against its fields."""
    load_methods()
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
