"""The merge's fold compiled (`kernels.jit`): every receiving kept token's row becomes the (weighted) mean of
itself and the dropped rows assigned to it, one receiver at a time, where the array code makes a zeroed
accumulator, an index_add over every source row, a gather, an add, a divide and a scatter (`tokens.base.
merge_dropped`).

Per receiver r with dropped source rows j_1 < j_2 < ... (ascending, the order in which index_add adds them):

    acc = ((0 + w_1 x_1) + w_2 x_2) + ...        out_r = (w_r x_r + acc) / (w_r + w_1 + w_2 + ...)

in the same float operations as the array code (no fused multiply-adds; with unit weights no products), so
the result equals it bit for bit. Element-wise work: no FLOPs are counted, as none are for the array code.
Receivers are split over the threads torch is allowed (`kernels.threads`); each writes only its own row.
"""

from __future__ import annotations

import numpy as np
import torch

from trimvlm.kernels.jit import njit
from trimvlm.kernels.threads import for_units


@njit
def fold_rows(src, dst, dst_at, starts, members, w_member, w_self, w_sum, weighted, receivers):
    """For each receiver r of `receivers`: dst[dst_at[r]] <- (dst[dst_at[r]] (* w_self[r]) + the sum of
    src[members[starts[r]:starts[r + 1]]] (each * w_member[...]), in that order) / w_sum[r]."""
    acc = np.empty(src.shape[1], dtype=src.dtype)
    for r in receivers:
        acc[:] = 0
        for m in range(starts[r], starts[r + 1]):
            row = src[members[m]]
            if weighted:
                w = w_member[m]
                for e in range(acc.shape[0]):
                    acc[e] += row[e] * w
            else:
                for e in range(acc.shape[0]):
                    acc[e] += row[e]
        out = dst[dst_at[r]]
        ws, total = w_self[r], w_sum[r]
        for e in range(acc.shape[0]):
            mine = out[e] * ws if weighted else out[e]
            out[e] = (mine + acc[e]) / total


class Receivers:
    """The fold's plan for one merge, made once and applied to the hidden states and every tensor merged with them:
    receiver r = 0..R-1 at flat row dst_at[r] takes the dropped source rows src_at[i] whose inv[i] == r, in the
    order the torch path adds them, with weights w_drop [i], w_self [R] and their sum w_sum [R] (`weighted`;
    else unit weights)."""

    def __init__(self, dst_at, inv, src_at, w_drop, w_self, w_sum, weighted: bool) -> None:
        n_recv = dst_at.numel()
        # per receiver, its rows in the order the array code adds them: by source row with unit weights (its
        # index_add runs over every source row), in src_at's order with weights (over the gathered rows)
        within = src_at if not weighted else torch.arange(inv.numel(), device=inv.device)
        order = torch.argsort(inv * (int(within.max()) + 1 if within.numel() else 1) + within)
        starts = torch.zeros(n_recv + 1, dtype=torch.int64, device=inv.device)
        starts[1:] = torch.bincount(inv, minlength=n_recv).cumsum(0)
        self.rows = (_host(dst_at), _host(starts), _host(src_at[order]))
        self.weights = (w_drop[order], w_self, w_sum)  # cast to the rows' dtype when applied
        self.weighted = weighted
        self.receivers = np.arange(n_recv)
        self.work = inv.numel() + 2 * n_recv  # rows read and written, all receivers together

    def fold(self, flat_src: torch.Tensor, flat_dst: torch.Tensor) -> None:
        """In place in flat_dst [S', D] (CPU, contiguous, the dtype of flat_src [S, D]). The receivers go to the
        threads when their work together is worth a pool call (`kernels.threads`)."""
        dt = flat_src.dtype
        args = (flat_src.detach().numpy(), flat_dst.detach().numpy(), *self.rows,
                *(_host(w.to(dt)) for w in self.weights), self.weighted)  # fmt: skip
        for_units(lambda units: fold_rows(*args, units), self.receivers, int(flat_src.shape[1]) * self.work)


def _host(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())
