"""ChartQA's relaxed accuracy (Masry et al. 2022; the form Pix2Struct's evaluation code uses).

A prediction is right when both it and the reference read as numbers and differ by at most 5% of the
reference (a trailing "%" divides by 100, so "12%" reads as 0.12); otherwise, or when the reference is 0, when
the two strings are equal ignoring case. Surrounding spaces are ignored; nothing else is normalised (a
trailing period or a thousands comma makes a number a string, as in the original)."""

from __future__ import annotations

import math
from collections.abc import Sequence

TOLERANCE = 0.05


def to_number(text: str) -> float | None:
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def relaxed_match(prediction: str, reference: str, tolerance: float = TOLERANCE) -> bool:
    p, r = to_number(prediction), to_number(reference)
    if p is not None and r is not None and r != 0:
        return abs(p - r) / abs(r) <= tolerance
    return str(prediction).strip().lower() == str(reference).strip().lower()


def relaxed_accuracy(prediction: str, references: Sequence[str], tolerance: float = TOLERANCE) -> float:
    """1.0 if the prediction matches any reference under the relaxed rule, else 0.0."""
    return float(any(relaxed_match(prediction, r, tolerance) for r in references))
