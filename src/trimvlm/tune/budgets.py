"""Budgets of `trimvlm tune`: ratios to the uncompressed model on the same items, per cost axis (`AXES`;
docs/tune.md says what each counts). Values of one axis are several budget points; values of different axes
combine (the product over axes): `--budget total_flops=0.85 --budget total_flops=0.75 --budget kv_bytes=0.3`
gives {total_flops 0.85, kv_bytes 0.3} and {total_flops 0.75, kv_bytes 0.3}.
"""

from __future__ import annotations

import itertools

from trimvlm.errors import InputError

AXES = ("total_flops", "prefill_flops", "kv_bytes", "latency")
RESULT_KEY = {a: a for a in AXES} | {"latency": "latency_s"}  # axis -> its key in a result row's ratios


def parse_budget(text: str) -> tuple[str, float]:
    """"axis=ratio" -> (axis, ratio), ratio in (0, 1]."""
    axis, sep, value = str(text).partition("=")
    axis = axis.strip()
    if not sep:
        raise InputError(f"budget {text!r} is not axis=ratio; e.g. total_flops=0.5 (axes: {', '.join(AXES)})")
    if axis not in AXES:
        raise InputError(f"unknown budget axis {axis!r}; allowed: {', '.join(AXES)}")
    try:
        ratio = float(value)
    except ValueError:
        raise InputError(f"budget {text!r}: {value!r} is not a number (a ratio in (0, 1])") from None
    if not 0 < ratio <= 1:
        raise InputError(f"budget {text!r}: the ratio must be in (0, 1] (a fraction of the baseline's cost)")
    return axis, ratio


def budget_points(texts) -> list[dict[str, float]]:
    """The budget points: one value per axis, the product over axes, in the order given."""
    if isinstance(texts, str | dict):
        texts = [texts]
    if not texts:
        raise InputError("give at least one budget, e.g. --budget total_flops=0.5")
    by_axis: dict[str, list[float]] = {}
    for t in texts:
        pairs = t.items() if isinstance(t, dict) else [parse_budget(t)]
        for axis, ratio in pairs:
            axis, ratio = parse_budget(f"{axis}={ratio}")
            if ratio not in by_axis.setdefault(axis, []):
                by_axis[axis].append(ratio)
    axes = list(by_axis)
    return [dict(zip(axes, vals, strict=True)) for vals in itertools.product(*(by_axis[a] for a in axes))]


def label(point: dict[str, float]) -> str:
    return ",".join(f"{a}={v:g}" for a, v in point.items())


def fits(ratios: dict, point: dict[str, float], tol: float) -> bool:
    """Whether measured ratios (result keys) meet every axis of the point within `tol`."""
    return all(ratios.get(RESULT_KEY[a]) is not None and ratios[RESULT_KEY[a]] <= v + tol for a, v in point.items())
