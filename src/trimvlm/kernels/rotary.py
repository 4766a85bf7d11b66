"""The vision towers' rotary embedding compiled (`kernels.jit`): one pass over q and k where the array code makes
several.

The Qwen-VL towers rotate each query and key head as x * cos + rotate_half(x) * sin in float32, with
rotate_half(x) = [-x2, x1] for the halves x1, x2 of the head: five array operations and a concatenation per
tensor, each a pass over all of it. Per element pair (a, b) = (x1[e], x2[e]) this is

    out[e]     = a * cos[e]     - b * sin[e]
    out[e + h] = b * cos[e + h] + a * sin[e + h]

which the loop computes in the same float32 operations (two rounded products, then the sum; a + (-p) is a - p
exactly), so the result equals the array code's bit for bit. Element-wise work: no FLOPs are counted for it,
as none are for the array code. The rows are split over the threads torch is allowed (`kernels.threads`).
"""

from __future__ import annotations

import numpy as np
import torch

from trimvlm.kernels import jit
from trimvlm.kernels.jit import njit
from trimvlm.kernels.threads import MIN_WORK, for_units

ROWS = 256  # rows (positions) per unit of work handed to a thread at least (more where the heads are small)


@njit
def rotate_rows(x, cos, sin, out, starts, rows):
    """out[i, j] = the rotated head x[i, j] for the positions i of the blocks `starts` (each `rows` long);
    x, out [S, H, d]; cos, sin [S, d]."""
    n, heads, d = x.shape
    h = d // 2
    for start in starts:
        for i in range(start, min(n, start + rows)):
            for j in range(heads):
                for e in range(h):
                    a = x[i, j, e]
                    b = x[i, j, e + h]
                    out[i, j, e] = a * cos[i, e] - b * sin[i, e]
                    out[i, j, e + h] = b * cos[i, e + h] + a * sin[i, e + h]


def usable(*tensors) -> bool:
    """Whether the compiled rotation runs on these tensors: numba on, float32 on the CPU, no autograd, [S, H, d]
    heads of even d with [S, d] cos / sin."""
    q, k, cos, sin = tensors
    return (
        jit.compiled(*tensors, cpu=True)
        and all(t.dtype == torch.float32 and not t.requires_grad for t in tensors)
        and q.dim() == k.dim() == 3
        and q.shape == k.shape
        and q.shape[-1] % 2 == 0
        and cos.shape == sin.shape == (q.shape[0], q.shape[-1])
    )


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, k) rotated (new float32 tensors); call only where `usable(q, k, cos, sin)`."""
    c, s = cos.contiguous().numpy(), sin.contiguous().numpy()
    n, heads, d = q.shape
    rows = min(max(ROWS, -(-MIN_WORK // (heads * d))), max(n, 1))  # a block worth a thread's start-up
    starts = np.arange(0, n, rows, dtype=np.int64)
    out = []
    for x in (q, k):
        o = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        xs, os_ = x.numpy(), o.numpy()
        for_units(lambda part, xs=xs, os_=os_: rotate_rows(xs, c, s, os_, part, rows), starts, rows * heads * d)
        out.append(o)
    return tuple(out)
