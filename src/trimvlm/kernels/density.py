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
    # Neighbours outside the grid (or masked) add 0 to the similarity sum and 0 to the count. Since
    # sum_n cos(x, x_n) = <xn, sum_n xn_n>, the neighbours' unit vectors are summed first: a window box sum
    # (sum pooling over each feature plane, read in place from the [B, h, w, d] layout) minus the cell itself,
    # then one dot product. The box sum is element-wise work, uncounted here as by torch's FlopCounterMode; it
    # is 1.7x faster than the shifted adds it replaced (docs/tokens.md, issue 20).
    ones = m if m is not None else xn.new_ones(b, h, w)
    acc = _box_sum(xn.permute(0, 3, 1, 2), window).permute(0, 2, 3, 1).sub_(xn)  # in place: no fresh pages
    count = _box_sum(ones[:, None], window)[:, 0] - ones
    sim = rowdot(xn, acc)  # counted as method FLOPs: 2 * N * d
    rho = 1.0 - sim / count.clamp(min=1.0)
    if m is not None:
        rho = rho * m
    if squeeze:
        rho = rho[0]
    if flat:
        rho = rho.reshape(*rho.shape[:-2], h * w)
    return rho


def _box_sum(x: torch.Tensor, window: int) -> torch.Tensor:
    """Sum of each [h, w] plane of x [B, C, h, w] over the `window` x `window` box around every cell, clipped at
    the border (sum pooling with zero padding)."""
    return F.avg_pool2d(x, window, stride=1, padding=window // 2, divisor_override=1)


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


# farthest point's rows per product: 64, and 128 from 400 picks on (one thread, interleaved, the same picks: at
# N = 4096, K = 820, d = 1024 the loop took 141-172 against 171-202 ms; at N = 1024, K = 205 / 102, 64 is fastest)
BLOCK, BLOCK_LARGE, LARGE_K = 64, 128, 400


def farthest_point(
    xn: torch.Tensor,
    mask: torch.Tensor,
    k: torch.Tensor,
    tilt: torch.Tensor,
    first: torch.Tensor,
    *,
    track_nearest: bool = False,
    block: int | None = None,
    pool: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Density-tilted farthest-point selection, vectorised over the rows (units) of a padded batch.

        s_0 = first;  s_t = argmax_{j not in S} (mind_j + tilt_j),  mind_j <- min(mind_j, 1 - <xn_j, xn_{s_t}>)

    xn [U, N, d] unit-normalised features; mask [U, N] real tokens; k [U] picks per row; tilt [U, N]
    (beta * rho~); first [U] the first pick. Ties go to the lowest index.

    Each pick needs one distance row D[s_t, :] per unit: K x N x d multiply-adds in all, the method's compute
    floor. The rows are computed `block` at a time as one [block, d] x [d, N] product (a compute-bound matrix
    product instead of a memory-bound matrix-vector product per pick), for the picks the rule is predicted to
    make next: the rule is run ahead on the `pool` (default 2 x block) best current candidates, with their
    [pool, pool] distances (`_predict`; `block` default: BLOCK, or BLOCK_LARGE from LARGE_K picks). A unit
    whose pick is not among its cached rows refills (only that unit). The prediction only chooses which rows
    to compute: every pick is still the exact argmax of the exact current scores over all N tokens, from the
    computed rows (block = 1 is the plain one-row-per-pick loop). The O(N) per-pick bookkeeping (running min,
    tilt, argmax) is done on [U, N] numpy arrays on the host, whose per-call overhead is a fraction of a torch
    op's. Memory O(U * block * N) beyond the features: no N x N matrix.

    Returns picks [U, max k] (row u valid up to k[u]) and, with `track_nearest`, nearest [U, N]: the pick among
    row u's first k[u] closest in cosine distance to each token (the earliest such pick on ties).
    """
    u, n, d = xn.shape
    kmax = int(k.max())
    block = block or (BLOCK_LARGE if kmax >= LARGE_K else BLOCK)
    m = max(1, min(block, n))
    dev = xn.device
    ks = np.asarray(k.tolist())
    ragged = int(ks.min()) != kmax
    live = tilt.masked_fill(~mask, float("-inf")).to(xn.dtype).detach().cpu().numpy().reshape(-1).copy()
    live2d = live.reshape(u, n)  # -inf marks pads and tokens already picked
    base = np.arange(u) * n
    mind = score = None
    near_t = np.zeros((u, n), dtype=np.int64) if track_nearest else None  # pick step of the nearest pick
    xf = xn.reshape(u * n, d).contiguous()  # the rows the products gather (copied once if xn is strided)
    rows = torch.empty(u, m, n, dtype=xn.dtype, device=dev)  # per unit, the cached distance rows
    host = None if dev.type == "cpu" else np.empty((u, m, n), dtype=live.dtype)
    rows_np = rows.numpy() if host is None else host  # what the loop reads (on the CPU: the same memory)
    slot = np.full((u, n), -1, dtype=np.int64)  # per unit, token -> its row in rows_np (-1: not cached)
    ar = np.arange(u)
    out = []
    s = np.asarray(first.tolist(), dtype=np.int64)
    for t in range(kmax):
        out.append(s)
        live[base + s] = -np.inf
        last = t == kmax - 1
        if last and not track_nearest:
            break
        at = slot[ar, s]
        miss = (at < 0) & (t < ks)  # a unit past its k reads any row (set to inf below)
        if miss.any():
            _refill((xn, xf), mind, live2d, s, miss, ks - t, (rows, host), slot, pool or 2 * m)
            at = slot[ar, s]
        dist = rows_np[ar, at]  # [U, N] = D[s_t, :] (a copy)
        if ragged and t >= ks.min():  # rows that already have their k picks stop updating
            dist[t >= ks] = np.inf
        if mind is None:
            mind = dist
            score = np.empty_like(mind)
        else:
            if track_nearest:
                np.putmask(near_t, dist < mind, t)
            np.minimum(mind, dist, out=mind)
        if last:
            break
        np.add(mind, live2d, out=score)
        s = score.argmax(1)
    picks = torch.from_numpy(np.stack(out, 1)).to(dev)
    nearest = picks.gather(1, torch.from_numpy(near_t).to(dev)) if track_nearest else None
    return picks, nearest


def _refill(xs, mind, live, s, miss, left, cache, slot, pool: int) -> None:
    """Refill farthest point's cache for the units `miss` [U] bool whose pick `s` has no cached row: the
    distance rows [m, N] of `s` and of the m - 1 picks `_predict` expects next, written into `cache` (a torch
    tensor [U, m, N] on the features' device and the host array the loop reads, one memory on the CPU), with
    `slot` [U, N] (token -> row) updated."""
    (xn, xf), (rows, host) = xs, cache
    u, n, d = xn.shape
    m = rows.shape[1]
    who = np.flatnonzero(miss)
    cur = live[who] if mind is None else mind[who] + live[who]  # current scores [U', N]
    mw = None if mind is None else mind[who]
    picks = _predict(xs, who, cur, mw, live[who], s[who], min(m, int(left[who].max())), min(pool, n))
    q = picks.shape[1]
    flat = torch.from_numpy((who[:, None] * n + picks).reshape(-1)).to(xn.device)
    want = xf.index_select(0, flat).reshape(len(who), q, d)
    # the whole batch in one product, or each unit that missed against its own tokens (no copy of features)
    parts = (
        [(slice(None), want, xn)]
        if len(who) == u
        else [(slice(i, i + 1), want[j : j + 1], xn[i : i + 1]) for j, i in enumerate(who.tolist())]
    )
    for at, a, b in parts:
        dst = rows[at, :q]
        bmm(a, b.transpose(1, 2), out=dst)
        dst.neg_().add_(1.0)  # 1 - <xn_i, xn_j>, the same float as 1.0 - product
    if host is not None:
        host[who, :q] = rows[torch.from_numpy(who).to(rows.device), :q].cpu().numpy()
    slot[who] = -1
    for j in range(q - 1, -1, -1):  # a token predicted twice (out of candidates) keeps its first row
        slot[who, picks[:, j]] = j


def _predict(xs, who, cur, mind, live, s, q: int, pool: int) -> np.ndarray:
    """[U', q] per unit `who` the picks the rule makes from `s` on, run ahead on the unit's `pool` best current
    candidates (by `cur` [U', N]; the other tokens assumed out of reach) with their [pool, pool] distances
    (one counted product). A guess of which rows to compute, nothing more: the caller checks every pick."""
    (xn, xf), w = xs, len(who)
    n, d = xn.shape[1:]
    if q == 1 or pool <= 1:
        return s[:, None]
    rr = np.arange(w)
    sc = cur.copy()
    sc[rr, s] = np.inf
    cand = np.sort(np.argpartition(-sc, pool - 1, axis=1)[:, :pool], axis=1)  # index order, as argmax ties
    flat = torch.from_numpy((who[:, None] * n + cand).reshape(-1)).to(xn.device)
    c = xf.index_select(0, flat).reshape(w, pool, d)
    g = (1.0 - bmm(c, c.transpose(1, 2))).cpu().numpy()
    mc = np.full((w, pool), np.inf, dtype=g.dtype) if mind is None else np.take_along_axis(mind, cand, 1)
    lc = np.take_along_axis(live, cand, 1)
    pos = (cand == s[:, None]).argmax(1)
    out = np.empty((w, q), dtype=np.int64)
    out[:, 0] = s
    for j in range(1, q):
        np.minimum(mc, g[rr, pos], out=mc)
        lc[rr, pos] = -np.inf
        pos = (mc + lc).argmax(1)
        out[:, j] = cand[rr, pos]
    return out


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
