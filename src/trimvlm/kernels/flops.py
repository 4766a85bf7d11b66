"""Method FLOPs: the matmuls a method runs on top of the model (selection distance rows, attention-probe rows,
merge assignment, density windows, router), counted on a line of their own.

The runner opens `counting(meter, phase)` around everything it runs in a phase; a method's kernels call
`count(flops)` (or run their products through `bmm` / `matmul` here, which count and compute), and the FLOPs
land in `Costs.method_flops[phase]`, never in the model's line. Same rule as the model's line and torch's
FlopCounterMode: 2 per multiply-add of a matrix product; element-wise work is not counted. The active counter
lives in a context variable, so two runners in two threads never count into each other's meter.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar

import torch
from torch.utils.flop_counter import register_flop_formula

_ACTIVE: ContextVar[tuple | None] = ContextVar("trimvlm_method_flops", default=None)


@contextlib.contextmanager
def counting(meter, phase: str):
    """Count method FLOPs into `meter` (anything with `add_method(phase, flops)`) under `phase`."""
    token = _ACTIVE.set((meter, phase) if meter is not None else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def paused():
    """Run model work (not the method's) inside a counted region without counting it."""
    return counting(None, "")


def count(flops: int) -> None:
    active = _ACTIVE.get()
    if active is not None and flops:
        active[0].add_method(active[1], int(flops))


def matmul_flops(a_shape, b_shape) -> int:
    """2 * (broadcast batch) * m * k * n for torch.matmul of two tensors with >= 2 dims."""
    *ba, m, k = a_shape
    *bb, k2, n = b_shape
    if k != k2:
        raise ValueError(f"matmul shapes {tuple(a_shape)} and {tuple(b_shape)} do not match")
    batch = math.prod(ba if ba == bb else torch.broadcast_shapes(tuple(ba), tuple(bb)))  # equal: no torch call
    return 2 * batch * m * k * n


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    count(matmul_flops(a.shape, b.shape))
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    count(matmul_flops(a.shape, b.shape))
    return torch.matmul(a, b)


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) over broadcast rows, counted as 2 * rows * d (`torch.linalg.vecdot`: one pass, where a
    batch of [1, d] x [d, 1] products took 5x as long at 4 x 1024 rows of 1024; as the op `trimvlm::rowdot`,
    which torch's FlopCounterMode counts the same, so the method line still equals torch's counter)."""
    lead = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    count(2 * math.prod(lead) * a.shape[-1])
    return _rowdot(a, b)


@torch.library.custom_op("trimvlm::rowdot", mutates_args=())
def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(a, b)


@_rowdot.register_fake
def _(a, b):
    return a.new_empty(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]))


@register_flop_formula(torch.ops.trimvlm.rowdot)
def _rowdot_flops(a_shape, b_shape, *_, out_shape=None, **__) -> int:
    return 2 * math.prod(out_shape) * a_shape[-1]
