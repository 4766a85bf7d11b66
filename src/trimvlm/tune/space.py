"""The search space of `trimvlm tune`: a YAML file (the default is `tune/space.yaml`) read into families.

A *family* is a recipe with one free knob or none: its token reducer's `keep`, found per budget by bisection.
Families are the grid of every listed option of every method, joined across axes as `combine` says
(`tokens+depth`: every token grid point with every depth grid point). Every grid point is built through the
registry (`trimvlm.plan.build_methods`) when the file is read, so an unknown method or option fails then, with
the file named, before any model runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trimvlm.errors import InputError, RecipeError
from trimvlm.plan import build_methods

DEFAULT_SPACE = Path(__file__).with_name("space.yaml")
AXES = ("tokens", "kv", "depth")
CALIBRATED = ("block-influence", "sensitivity", "greedy-kl")  # rankers tune calibrates (a ranking file each)
SHORT = {"block-influence": "bi", "sensitivity": "sens", "greedy-kl": "kl"}
PROBE_KEEP = 0.5  # the keep a token grid point is validated with


@dataclass
class Family:
    name: str
    parts: dict[str, str]  # axis -> method spec; a token spec has "{keep}" in it
    free: bool  # whether `keep` is free (a token reducer is part of it)

    def recipe(self, keep: float | None = None, name: str | None = None) -> dict:
        out = {a: s.format(keep=f"{keep:.10g}" if keep is not None else "?") for a, s in self.parts.items()}
        return {"name": name or self.name, **out}


@dataclass
class Space:
    path: str
    points: dict[str, list[tuple[str, str]]]  # axis -> (short name, spec) grid points
    combine: list[tuple[str, ...]]
    keep_low: float = 0.02
    keep_high: float = 1.0
    rankers: list[str] = field(default_factory=list)  # calibrated rankers the depth points read
    beam: int | None = None  # joint families formed with the best `beam` token families only (None: all)

    def families(self) -> list[Family]:
        out = []
        for axes in self.combine:
            grids = [self.points.get(a, []) for a in axes]
            for combo in itertools.product(*grids):
                parts = {a: spec for a, (_, spec) in zip(axes, combo, strict=True)}
                out.append(Family("+".join(n for n, _ in combo), parts, "tokens" in axes))
        return out


def _grid(entry: dict) -> list[dict]:
    lists = {k: (v if isinstance(v, list) else [v]) for k, v in entry.items() if k != "method"}
    keys = sorted(lists)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(lists[k] for k in keys))]


def _spec(method: str, opts: dict) -> str:
    return ":".join([method] + [f"{k}={v}" for k, v in opts.items()])


def _short(method: str, opts: dict) -> str:
    return SHORT.get(method, method) + "".join(f"_{k[0]}{v}" for k, v in opts.items() if k != "scope")


def load_space(path: str | Path | None = None, rankings: str | Path = "rankings") -> Space:
    """Read and validate a space file; calibrated depth rankers read `rankings/<method>.json`."""
    path = Path(path) if path is not None else DEFAULT_SPACE
    if not path.exists():
        raise InputError(f"space file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise InputError(f"space file {path} does not parse as YAML: {e}") from e
    if not isinstance(data, dict):
        raise InputError(f"space file {path}: expected a mapping with tokens / kv / depth / combine / keep")
    unknown = set(data) - {*AXES, "combine", "keep", "beam"}
    if unknown:
        raise InputError(f"space file {path}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(AXES)}, combine, keep")
    points: dict[str, list[tuple[str, str]]] = {}
    rankers: list[str] = []
    for axis in AXES:
        for entry in data.get(axis) or []:
            if not isinstance(entry, dict) or "method" not in entry:
                raise InputError(f"space file {path}: each {axis} entry is a mapping with a method, got {entry!r}")
            method = str(entry["method"])
            if axis == "tokens" and ("keep" in entry or "prune" in entry):
                raise InputError(f"space file {path}: tokens={method} lists keep; it is the free knob tune bisects")
            for opts in _grid(entry):
                if axis == "depth":
                    opts.setdefault("scope", "all")
                spec = _spec(method, opts)
                if axis == "tokens":
                    spec, check = _spec(method, {**opts, "keep": "{keep}"}), _spec(method, {**opts, "keep": PROBE_KEEP})
                elif axis == "depth" and method in CALIBRATED:
                    rankers.append(method)
                    spec = _spec("ranking", {"file": Path(rankings) / f"{method}.json", **opts})
                    check = _spec("skip", {"layers": 0, "scope": opts["scope"]})  # the ranking file comes later
                    if set(opts) - {"budget", "scope"}:
                        raise InputError(f"space file {path}: depth={method} takes budget and scope only, got {sorted(opts)}")
                else:
                    check = spec
                try:
                    build_methods({axis: check})
                except RecipeError as e:
                    raise InputError(f"space file {path}: {axis}={method}: {e}") from e
                points.setdefault(axis, []).append((_short(method, opts), spec))
    combine = []
    for c in data.get("combine") or ["tokens"]:
        axes = tuple(str(c).split("+"))
        if any(a not in AXES for a in axes) or len(set(axes)) != len(axes):
            raise InputError(f"space file {path}: combine entry {c!r}; use axes {', '.join(AXES)} joined by +")
        combine.append(axes)
    keep = data.get("keep") or {}
    low, high = float(keep.get("low", 0.02)), float(keep.get("high", 1.0))
    if not 0 < low < high <= 1:
        raise InputError(f"space file {path}: keep needs 0 < low < high <= 1, got low={low}, high={high}")
    beam = data.get("beam")
    if beam is not None and (not isinstance(beam, int) or isinstance(beam, bool) or beam < 1):
        raise InputError(f"space file {path}: beam must be a positive integer (or left out: every combination)")
    return Space(str(path), points, combine, low, high, sorted(set(rankers)), beam)
