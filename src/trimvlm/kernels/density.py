"""Density kernels shared by the prefill reducers and the KV policies (TwinPrune, REFERENCES.md section 1):
spatial density rho on a patch grid, its normalisations, and density-tilted farthest-point selection."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trimvlm.kernels.flops import bmm
from trimvlm.kernels.flops import count as count_flops


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
    b, h, w, d = x.shape
    dt = torch.promote_types(x.dtype, torch.float32)
    m = None
    if mask is not None:
        m = mask.reshape(b, h, w).to(device=x.device, dtype=dt)
    xn = x.to(dt) if normalized else F.normalize(x.to(dt), dim=-1, eps=1e-12)
    if m is not None:
        xn = xn * m[..., None]
    r = window // 2
    # Neighbours outside the grid (or masked) add 0 to the similarity sum and 0 to the count. cos is
    # symmetric, so each unordered neighbour pair is one dot product, added to both cells: (w^2 - 1) / 2
    # passes over the unit vectors, each one element-wise product summed over d (counted as method FLOPs),
    # and no [h, w, d] accumulator. (Measured against the 8 shifted [h, w, d] adds plus one dot product, a
    # separable box sum and a cumulative-sum box: 3-4x faster than the best of them; docs/tokens.md.)
    ones = m if m is not None else xn.new_ones(b, h, w)
    sim = xn.new_zeros(b, h, w)
    count = xn.new_zeros(b, h, w)
    for di in range(0, r + 1):
        for dj in range(-r, r + 1):
            if (di == 0 and dj <= 0) or di >= h or abs(dj) >= w:
                continue
            a_ = (slice(None), slice(0, h - di), slice(max(0, -dj), w - max(0, dj)))  # cell
            b_ = (slice(None), slice(di, h), slice(max(0, dj), w + min(0, dj)))  # its neighbour (+di, +dj)
            pair = (xn[a_] * xn[b_]).sum(-1)
            count_flops(2 * pair.numel() * d)
            sim[a_] += pair
            sim[b_] += pair
            both = ones[a_] * ones[b_]
            count[a_] += both
            count[b_] += both
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

    Every pick needs its distance row D[s_t, :] (O(N d)); nothing else is O(N d). The rows are computed ahead,
    as one [c, d] x [d, N] product per refill for the whole batch, for a candidate set C of the `block`
    highest current scores per row (scores only decrease, so the next picks are almost always among them),
    and a row stays cached until its token is picked or leaves C: about K + K/10 rows per row of the batch
    are computed in all (block = 32), so the selection costs close to its K N d multiply-adds at the matrix
    product rate. Between refills the per-pick work is on C alone: the candidates' scores are updated from the
    [block, block] distances among them, and a pick is taken from C only when it provably is the argmax of
    all scores: every token outside C scored at most tau (the best score outside C at the refill; ties by
    index) then, and scores only fall. Otherwise the batch refills: the running min over all N is brought up
    to date with the rows of the picks since the last refill (one [U, P, N] min), and C is chosen again. The
    rule is unchanged: every pick is the exact argmax of the exact current scores.
    Memory O(U * block * N) beyond the features: no N x N matrix.

    Returns picks [U, max k] (row u valid up to k[u], 0 past it) and, with `track_nearest`, nearest [U, N]:
    the pick among row u's first k[u] closest in cosine distance to each token (the earliest such pick on ties).
    """
    u, n, d = xn.shape
    dev, dt = xn.device, xn.dtype
    kmax = int(k.max()) if u else 0
    picks = np.zeros((u, kmax), dtype=np.int64)
    if kmax == 0:
        return torch.from_numpy(picks).to(dev), None
    m = max(1, min(block, n))
    ks = np.asarray(k.tolist(), dtype=np.int64)
    inf = float("inf")
    xf = xn.reshape(u * n, d)
    live = tilt.masked_fill(~mask, -inf).to(dt).clone()  # [U, N]: -inf on pads and on picked tokens
    mind = torch.full((u, n), inf, dtype=dt, device=dev)
    near_t = torch.zeros((u, n), dtype=torch.long, device=dev) if track_nearest else None
    tok = torch.arange(n, device=dev)
    base_n = torch.arange(u, device=dev)[:, None] * n
    base_s = torch.arange(u, device=dev)[:, None] * (m + 1)
    slots = torch.arange(m, device=dev)[None].expand(u, m)

    def rows_of(idx: torch.Tensor) -> torch.Tensor:
        """[U, c] token indices -> [U, c, N] their distance rows D[idx, :] (a transposed view): the product
        runs as [N, d] x [d, c], which keeps the matrix unit busy for small c."""
        q = xf.index_select(0, (base_n + idx).flatten()).view(u, idx.shape[1], d)
        return bmm(xn, q.transpose(1, 2)).transpose(1, 2)  # <xn_j, xn_idx>; D = 1 - that

    def catch_up(rows: torch.Tensor, t0: int) -> None:  # fold the rows of picks t0, t0+1, ... into mind
        nonlocal mind, near_t
        vals, arg = rows.min(1)  # the earliest pick on ties, as a step-by-step update keeps it
        if track_nearest:
            near_t = torch.where(vals < mind, arg + t0, near_t)
        mind = torch.minimum(mind, vals)

    s_dev = first.to(device=dev, dtype=torch.long).reshape(u)
    picks[:, 0] = s_dev.tolist()
    live.scatter_(1, s_dev[:, None], -inf)
    r0 = 1.0 - rows_of(s_dev[:, None])
    if bool((ks < 1).any()):  # rows asked for no pick do not take the first one either
        r0 = r0.masked_fill(torch.from_numpy(ks < 1).to(dev)[:, None, None], inf)
    catch_up(r0, 0)
    del r0
    buf = torch.full((u * (m + 1), n), inf, dtype=dt, device=dev)  # slot (u, j): row of candidate j; j = m: +inf
    slot_of = torch.full((u, n), -1, dtype=torch.long, device=dev)  # token -> slot holding its row
    pend = np.full((u, m), m, dtype=np.int64)  # slots picked since the last refill (m: none)
    pend_base = np.arange(u)[:, None] * (m + 1)
    state = dict(n_pend=0, t_pend=1)
    cand = dc = cmind = clive = thr = tie = None

    def refill(t: int) -> None:
        """Bring mind up to date with the picks since the last refill and choose every row's candidates again."""
        nonlocal buf, slot_of, cand, dc, cmind, clive, thr, tie
        n_pend, t_pend = state["n_pend"], state["t_pend"]
        if n_pend:
            idx = torch.from_numpy((pend[:, :n_pend] + pend_base).reshape(-1)).to(dev)
            catch_up(buf.index_select(0, idx).view(u, n_pend, n), t_pend)
            done = torch.from_numpy(picks[:, t_pend:t].copy()).to(dev)
            act = torch.from_numpy(np.arange(t_pend, t)[None] < ks[:, None]).to(dev)
            live.scatter_(1, done, torch.where(act, -inf, live.gather(1, done)))
        active = torch.from_numpy(ks > t).to(dev)
        sc = (mind + live).masked_fill(~active[:, None], -inf)
        # C = the m best scores, ties to the lower index; th / tie = the best (score, index) left outside
        if n > m:
            th = sc.topk(m + 1, dim=1).values[:, m : m + 1]
            gt, eq = sc > th, sc == th
            take = eq & (eq.long().cumsum(1) <= (m - gt.sum(1, keepdim=True)))
            tie_t = torch.where(eq & ~take, tok, n).amin(1)
            c_idx = (gt | take).nonzero()[:, 1].view(u, m)  # [U, m] in index order
            th = th[:, 0]
        else:
            c_idx = tok[None].expand(u, m)
            th = torch.full((u,), -inf, dtype=dt, device=dev)
            tie_t = torch.full((u,), n, dtype=torch.long, device=dev)
        old = slot_of.gather(1, c_idx)
        need = (old < 0) & (sc.gather(1, c_idx) > -inf)  # live candidates without a row yet
        c_new = int(need.sum(1).max())
        src = torch.cat([torch.where(old >= 0, old, m), slots[:, :1] * 0 + m], 1)  # m: the +inf row
        new = buf.index_select(0, (base_s + src).flatten())
        if c_new:
            order = torch.sort(need.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :c_new]
            rows = rows_of(c_idx.gather(1, order))  # past a row's own count: padding, computed and unused
            rank = need.long().cumsum(1) - 1
            nu, nj = need.nonzero(as_tuple=True)
            new.index_copy_(0, nu * (m + 1) + nj, 1.0 - rows[nu, rank[nu, nj]])
        buf = new
        has_row = (old >= 0) | need
        slot_of = torch.full_like(slot_of, -1).scatter_(1, c_idx, torch.where(has_row, slots, -1))
        cand = c_idx.cpu().numpy()
        dc = buf.view(u, m + 1, n).gather(2, c_idx[:, None, :].expand(-1, m + 1, -1)).cpu().numpy()
        cmind = mind.gather(1, c_idx).cpu().numpy()
        clive = live.gather(1, c_idx).cpu().numpy()
        thr, tie = th.cpu().numpy(), tie_t.cpu().numpy()
        state.update(n_pend=0, t_pend=t)
        pend.fill(m)

    ar_u = np.arange(u)
    for t in range(1, kmax):
        act = ks > t
        if cand is None:
            refill(t)
        score = cmind + clive  # the candidates' exact current scores
        p = score.argmax(1)
        best, s = score[ar_u, p], cand[ar_u, p]
        if not bool((~act | (best > thr) | ((best == thr) & (s < tie))).all()):
            refill(t)  # some row's best candidate may not beat a token outside its candidates
            score = cmind + clive
            p = score.argmax(1)
            s = cand[ar_u, p]
        picks[act, t] = s[act]
        pend[act, state["n_pend"]] = p[act]
        state["n_pend"] += 1
        clive[ar_u[act], p[act]] = -inf
        np.minimum(cmind, dc[ar_u, np.where(act, p, m)], out=cmind)
    if track_nearest and state["n_pend"]:
        idx = torch.from_numpy((pend[:, : state["n_pend"]] + pend_base).reshape(-1)).to(dev)
        catch_up(buf.index_select(0, idx).view(u, state["n_pend"], n), state["t_pend"])
    out = torch.from_numpy(picks).to(dev)
    nearest = out.gather(1, near_t) if track_nearest else None
    return out, nearest


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
