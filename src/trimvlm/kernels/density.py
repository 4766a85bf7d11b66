"""Density kernels shared by the prefill reducers and the KV policies (TwinPrune, REFERENCES.md section 1):
spatial density rho on a patch grid, its normalisations, and density-tilted farthest-point selection."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trimvlm.kernels.flops import bmm, rowdot


def spatial_density(
    features: torch.Tensor,
    window: int = 3,
    *,
    grid: tuple[int, int] | None = None,
    mask: torch.Tensor | None = None,
    normalized: bool = False,
) -> torch.Tensor:
    """Spatial density rho of visual tokens on their patch grid (TwinPrune eq. in section 4.1).

        rho_ij = 1 - (1/|N_w(i,j)|) * sum_{(i',j') in N_w(i,j)} cos(x_ij, x_i'j')

    N_w(i,j) is the `window` x `window` neighbourhood of (i,j), clipped at the grid border, excluding (i,j)
    itself. High rho = locally non-redundant. Cost O(N * window^2 * d) time, O(N * d) memory (no N x N matrix).

    Args:
        features: one image `[h, w, d]`, a batch of same-size grids `[B, h, w, d]`, or flat tokens `[N, d]`
            / `[B, N, d]` in row-major grid order together with `grid=(h, w)`.
        window: odd window side w >= 1 (default 3). w = 1 has no neighbours.
        grid: `(h, w)` when `features` is flat.
        mask: optional bool, same leading shape as the returned rho: False marks cells that are not tokens
            (grids of different sizes padded into one tensor, or tokens already removed). Those cells are not
            neighbours of anyone (they leave the sum and the count |N_w|); their own rho is returned as 0.
        normalized: the features are unit vectors already (F.normalize with eps 1e-12, as here), so the
            caller's copy is used as is (the selection that follows needs the same vectors).

    Returns:
        rho (float32; float64 for float64 input) with the input's leading shape minus the feature axis: `[h, w]`, `[B, h, w]`, `[N]` or
        `[B, N]`. A token without any neighbour (a 1x1 grid, or window = 1) gets rho = 1. Not normalised; use
        `normalize_density` for the min-max normalised rho~ in [0, 1].
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window must be an odd integer >= 1, got {window}")
    flat = grid is not None
    x = features
    if flat:
        h, w = grid
        if x.shape[-2] != h * w:
            raise ValueError(f"{x.shape[-2]} tokens do not fill a {h}x{w} grid")
        x = x.reshape(*x.shape[:-2], h, w, x.shape[-1])
    if x.dim() not in (3, 4):
        raise ValueError(
            f"features must be [h, w, d] or [B, h, w, d] (or flat with grid), got {tuple(x.shape)}"
        )
    squeeze = x.dim() == 3
    if squeeze:
        x = x[None]
    b, h, w, _ = x.shape
    dt = torch.promote_types(x.dtype, torch.float32)
    m = None
    if mask is not None:
        m = mask.reshape(b, h, w).to(device=x.device, dtype=dt)
    xn = x.to(dt) if normalized else F.normalize(x.to(dt), dim=-1, eps=1e-12)
    if m is not None:
        xn = xn * m[..., None]
    r = window // 2
    # Neighbours outside the grid (or masked) add 0 to the similarity sum and 0 to the count. Since
    # sum_n cos(x, x_n) = <xn, sum_n xn_n>, accumulate the neighbours' unit vectors, then take one dot product.
    # (One dot product per neighbour pair, added to both cells, runs 3x faster, but it is element-wise work,
    # which neither the method line nor torch's FlopCounterMode counts: see docs/tokens.md, issue 20.)
    acc = torch.zeros_like(xn)
    ones = m if m is not None else xn.new_ones(b, h, w)
    count = xn.new_zeros(b, h, w)
    for di in range(-r, r + 1):
        for dj in range(-r, r + 1):
            if (di == 0 and dj == 0) or abs(di) >= h or abs(dj) >= w:
                continue
            dst = (slice(None), slice(max(0, -di), h - max(0, di)), slice(max(0, -dj), w - max(0, dj)))
            src = (slice(None), slice(max(0, di), h + min(0, di)), slice(max(0, dj), w + min(0, dj)))
            acc[dst] += xn[src]
            count[dst] += ones[src]
    sim = rowdot(xn, acc)  # counted as method FLOPs: 2 * N * d
    rho = 1.0 - sim / count.clamp(min=1.0)
    if m is not None:
        rho = rho * m
    if squeeze:
        rho = rho[0]
    if flat:
        rho = rho.reshape(*rho.shape[:-2], h * w)
    return rho


def normalize_density(rho: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Min-max normalise rho to [0, 1] along `dim` (rho~). A constant rho maps to zeros."""
    lo = rho.amin(dim=dim, keepdim=True)
    hi = rho.amax(dim=dim, keepdim=True)
    return (rho - lo) / (hi - lo).clamp(min=1e-12)


def masked_minmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min-max normalise each row of x [U, N] over its `mask`ed entries to [0, 1]; -inf elsewhere."""
    x = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    lo = x.masked_fill(~mask, float("inf")).amin(1, keepdim=True)
    hi = x.masked_fill(~mask, float("-inf")).amax(1, keepdim=True)
    out = (x - lo) / (hi - lo).clamp(min=1e-12)
    return out.masked_fill(~mask, float("-inf"))


def farthest_point(
    xn: torch.Tensor,
    mask: torch.Tensor,
    k: torch.Tensor,
    tilt: torch.Tensor,
    first: torch.Tensor,
    *,
    track_nearest: bool = False,
    block: int = 32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Density-tilted farthest-point selection, vectorised over the rows (units) of a padded batch.

        s_0 = first;  s_t = argmax_{j not in S} (mind_j + tilt_j),  mind_j <- min(mind_j, 1 - <xn_j, xn_{s_t}>)

    xn [U, N, d] unit-normalised features; mask [U, N] real tokens; k [U] picks per row; tilt [U, N]
    (beta * rho~); first [U] the first pick. Ties go to the lowest index.

    Each pick needs one distance row D[s_t, :] per unit: O(N d) time, and the per-pick update is O(N). The
    rows are computed `block` at a time, for the `block` candidates with the highest current score (the next
    picks are almost always among them, since scores only decrease), as one [block, d] x [d, N] product, and
    recomputed only when a pick falls outside the cached candidates: on a CPU this turns a memory-bound
    matrix-vector product per pick into a compute-bound matrix product per block. The rule is unchanged: every
    pick is the exact argmax of the exact current scores (block = 1 is the plain one-row-per-pick loop).
    The O(N) per-pick bookkeeping (running min, tilt, argmax) is done on [U, N] numpy arrays on the host, whose
    per-call overhead is a fraction of a torch op's (about 25 us per pick at N = 1024 instead of 60-150).
    Memory O(U * block * N) beyond the features: no N x N matrix.

    Returns picks [U, max k] (row u valid up to k[u]) and, with `track_nearest`, nearest [U, N]: the pick among
    row u's first k[u] closest in cosine distance to each token (the earliest such pick on ties).
    """
    u, n, d = xn.shape
    kmax = int(k.max())
    m = max(1, min(block, n))
    dev = xn.device
    ks = np.asarray(k.tolist())
    ragged = int(ks.min()) != kmax
    # The per-pick bookkeeping is O(N) work on [U, N] vectors: it runs in numpy, whose per-call overhead is a
    # fraction of a torch op's; the O(N d) distance rows come from torch on the features' device.
    live = tilt.masked_fill(~mask, float("-inf")).to(xn.dtype).detach().cpu().numpy().reshape(-1).copy()
    live2d = live.reshape(u, n)  # -inf marks pads and tokens already picked
    base = np.arange(u) * n
    mind = score = None
    near_t = np.zeros((u, n), dtype=np.int64) if track_nearest else None  # pick step of the nearest pick
    cached: list[dict[int, int]] = [{} for _ in range(u)]  # token -> row of the cached block, per unit
    rows_np = None
    out = []
    s = np.asarray(first.tolist(), dtype=np.int64)
    for t in range(kmax):
        out.append(s)
        live[base + s] = -np.inf
        last = t == kmax - 1
        if last and not track_nearest:
            break
        s_list = s.tolist()
        if any(j not in c for j, c in zip(s_list, cached, strict=True)):
            rows_np, cached = _distance_rows(xn, live2d if mind is None else mind + live2d, s, m)
        if u == 1:
            dist = rows_np[cached[0][s_list[0]]][None]  # [1, N] = D[s_t, :] (a view)
        else:
            dist = rows_np[[i * m + c[j] for i, (j, c) in enumerate(zip(s_list, cached, strict=True))]]
        if ragged and t >= ks.min():  # rows that already have their k picks stop updating
            dist[t >= ks] = np.inf
        if mind is None:
            mind = dist.copy()
            score = np.empty_like(mind)
        else:
            if track_nearest:
                near_t[dist < mind] = t
            np.minimum(mind, dist, out=mind)
        if last:
            break
        np.add(mind, live2d, out=score)
        s = score.argmax(1)
    picks = torch.from_numpy(np.stack(out, 1)).to(dev)
    nearest = picks.gather(1, torch.from_numpy(near_t).to(dev)) if track_nearest else None
    return picks, nearest


def _distance_rows(xn: torch.Tensor, score: np.ndarray, s: np.ndarray, m: int):
    """Refill of farthest point's cache: the distance rows [U * m, N] (host) of each unit's pick `s` and its
    m - 1 best other candidates by the current `score` [U, N], and per unit token -> row of the block."""
    u, n, d = xn.shape
    sc = score.copy()
    sc[np.arange(u), s] = np.inf
    idx = torch.from_numpy(sc).to(xn.device).topk(m, dim=1).indices
    rows = xn.gather(1, idx[..., None].expand(-1, -1, d))
    dist_rows = 1.0 - bmm(rows, xn.transpose(1, 2))  # [U, m, N] rows of D
    return dist_rows.reshape(u * m, n).cpu().numpy(), [{j: r for r, j in enumerate(row)} for row in idx.tolist()]


def most_isolated(xn: torch.Tensor, mask: torch.Tensor, block: int = 256) -> torch.Tensor:
    """[U] per row the token farthest from its nearest other token in cosine distance,
    argmax_j min_{i != j} (1 - <xn_i, xn_j>), over the `mask`ed tokens (ties: the lowest index). A row with one
    token picks it. Row blocks of `block` x N distances; counted as method FLOPs."""
    u, n, _ = xn.shape
    nearest = torch.full((u, n), float("inf"), dtype=xn.dtype, device=xn.device)
    ar = torch.arange(n, device=xn.device)
    for s in range(0, n, block):
        d = 1.0 - bmm(xn[:, s : s + block], xn.transpose(1, 2))  # [U, b, N]
        d = d.masked_fill(~mask[:, None, :], float("inf"))
        d[:, ar[s : s + block] - s, ar[s : s + block]] = float("inf")  # not its own neighbour
        nearest[:, s : s + block] = d.amin(-1)
    lonely = torch.isinf(nearest) & mask  # a token with no other token in its row
    score = torch.where(lonely, torch.zeros_like(nearest), nearest).masked_fill(~mask, float("-inf"))
    return score.argmax(1)
