"""Density-tilted farthest-point selection (TwinPrune, docs/references.md#density-tilted-farthest-point;
DivPrune's max-min with no tilt): the distance rows computed a block at a time as matrix products, the
per-pick loop compiled (`kernels.picks`) or in numpy (`kernels.jit`: the fallback), the same picks either
way."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from trimvlm.kernels import jit
from trimvlm.kernels.flops import bmm
from trimvlm.kernels.threads import for_units

# Rows per distance product at most (N where N is smaller); the look-ahead pool: N / 4 within POOL_MIN..2 x block
# (tuned on one thread at d = 1024-2048, N = 576-4096, K = N / 5).
BLOCK, POOL_MIN = 256, 128
# The first refill's guess (nothing is certain before the first distance row is known) is computed in stages
# from its one pool product: STAGE rows where the pool holds under a fifth of the tokens, else GUESS, then twice
# the last stage's while the guess keeps being the rule's picks (at most one stage of rows goes unused).
STAGE, GUESS = 32, 128
# A later refill whose pick is among its unit's last pool first runs the rule ahead on that pool again with the
# current scores (the same certainty) and takes the run when it is at least REUSE_MIN picks: no new pool product.
REUSE, REUSE_MIN = True, 16
GRAM_BLOCK = 256  # the look-ahead pool's products: rows per product of its upper block triangle (0: one product)


def farthest_point(
    xn: torch.Tensor,
    mask: torch.Tensor,
    k: torch.Tensor,
    tilt: torch.Tensor,
    first: torch.Tensor,
    *,
    track_nearest: bool = False,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Density-tilted farthest-point selection, vectorised over the rows (units) of a padded batch.

        s_0 = first;  s_t = argmax_{j not in S} (mind_j + tilt_j),  mind_j <- min(mind_j, 1 - <xn_j, xn_{s_t}>)

    xn [U, N, d] unit-normalised features; mask [U, N] real tokens; k [U] picks per row; tilt [U, N]
    (beta * rho~); first [U] the first pick. Ties go to the lowest index.

    Each pick needs one distance row D[s_t, :] per unit (K x N x d multiply-adds in all, the method's compute
    floor). The rows are computed up to `block` (default BLOCK, at most N) at a time as one [q, d] x [d, N]
    product, for the picks the rule is certain to make next: the rule run ahead on the pool of the best current
    candidates (N / 4 within POOL_MIN..2 x block; 2 x block with an explicit block) with their
    [pool, pool] distances, while its picks score above every token outside the pool (`_predict`; the first
    refill guesses, in stages). A unit whose pick has no cached row refills alone, from its last pool when the
    run is long enough (`_reuse`), else from a new pool. The prediction only chooses which rows to compute: every
    pick is the exact argmax of the exact current scores over all N tokens (block = 1 is the plain loop). The
    O(N) per-pick bookkeeping runs compiled (`kernels.picks`, units on the threads of `kernels.threads`) or as
    numpy array operations (the fallback); both give the same picks, rows and method FLOPs. Memory
    O(U * block * N) beyond the features: no N x N matrix.

    Returns picks [U, max k] (row u valid up to k[u]) and, with `track_nearest`, nearest [U, N]: the pick among
    row u's first k[u] closest in cosine distance to each token (the earliest such pick on ties).
    """
    u, n, _ = xn.shape
    kmax = int(k.max())
    m = max(1, min(block or BLOCK, n))
    dev = xn.device
    live = tilt.masked_fill(~mask, float("-inf")).to(xn.dtype).detach().cpu().numpy().reshape(u, n).copy()
    rows = torch.empty(u, m, n, dtype=xn.dtype, device=dev)  # per unit, the cached rows <xn_s, xn_j> (1 - distance)
    host = None if dev.type == "cpu" else np.empty((u, m, n), dtype=live.dtype)
    st = SimpleNamespace(
        xs=(xn, xn.reshape(u * n, -1).contiguous()),  # the rows the products gather (copied once if strided)
        ks=np.asarray(k.tolist(), dtype=np.int64), kmax=kmax, live=live, track=track_nearest,
        near=np.zeros((u, n) if track_nearest else (1, 1), dtype=np.int64),  # pick step of the nearest pick
        cache=(rows, host), rows_np=rows.numpy() if host is None else host,  # on the CPU: the same memory
        slot=np.full((u, n), -1, dtype=np.int64),  # per unit, token -> its row in rows_np (-1: not cached)
        pool=min(2 * m, max(POOL_MIN, n // 4)) if block is None else 2 * m,
        s=np.asarray(first.tolist(), dtype=np.int64),
        pools={},  # per unit, its last look-ahead pool: candidates [P] and their products [P, P]
        guess=None,  # the first refill's guess: [U, q] picks, [U] the next stage's start (-1: none), its last rows
    )  # fmt: skip
    with np.errstate(invalid="ignore"):  # inf + -inf (a unit past its tokens) is NaN by the rule, not an error
        out = _compiled(st) if jit.compiled(xn) and kmax > 0 else _numpy_loop(st)
    picks = torch.from_numpy(out).to(dev)
    nearest = picks.gather(1, torch.from_numpy(st.near).to(dev)) if track_nearest else None
    return picks, nearest


def _numpy_loop(st) -> np.ndarray:
    """The loop as numpy array operations, every unit in step: [U, kmax] picks."""
    u, n = st.live.shape
    live, s, ks, kmax = st.live.reshape(-1), st.s, st.ks, st.kmax
    ragged = kmax > 0 and int(ks.min()) != kmax
    base, ar = np.arange(u) * n, np.arange(u)
    mind = score = None
    out = []
    for t in range(kmax):
        out.append(s)
        live[base + s] = -np.inf
        last = t == kmax - 1
        if last and not st.track:
            break
        at = st.slot[ar, s]
        miss = (at < 0) & (t < ks)  # a unit past its k reads any row (set to inf below)
        if miss.any():
            _refill(st, mind, s, miss, t)
            at = st.slot[ar, s]
        dist = 1.0 - st.rows_np[ar, at]  # [U, N] = D[s_t, :] (the rows hold the products)
        if ragged and t >= ks.min():  # rows that already have their k picks stop updating
            dist[t >= ks] = np.inf
        if mind is None:
            mind = dist
            score = np.empty_like(mind)
        else:
            if st.track:
                np.putmask(st.near, dist < mind, t)
            np.minimum(mind, dist, out=mind)
        if last:
            break
        np.add(mind, st.live, out=score)
        s = score.argmax(1)
    return np.stack(out, 1) if out else np.zeros((u, 0), dtype=np.int64)


def _compiled(st) -> np.ndarray:
    """The loop compiled (`picks.fps_advance`), each unit on its own up to its next miss; the units that miss at
    the earliest step are refilled together, as the numpy loop does at that step: [U, kmax] picks."""
    from trimvlm.kernels.picks import fps_advance

    u, n = st.live.shape
    out = np.zeros((u, st.kmax), dtype=np.int64)
    mind = np.empty_like(st.live)
    tt = np.zeros(u, dtype=np.int64)
    s = st.s.copy()

    def advance(units):
        fps_advance(st.rows_np, st.slot, mind, st.live, st.near, st.ks, s, tt, out, st.kmax, st.track, units)

    todo = np.arange(u)
    while True:
        for_units(advance, todo, n * st.kmax)
        waiting = tt < st.kmax
        if not waiting.any():
            return out
        t = int(tt[waiting].min())
        miss = tt == t
        _refill(st, mind if t else None, s, miss, t)
        todo = np.flatnonzero(miss)


def _refill(st, mind, s, miss, t: int) -> None:
    """Refill farthest point's cache for the units `miss` [U] bool whose pick `s` at step t has no cached row:
    the product rows [q, N] (q <= m; the distances are 1 - them) of `s` and of the q - 1 picks the look-ahead is
    certain of next (`_reuse`, else `_predict`; or the first refill's next stage of guesses), written into the
    cache (a torch tensor [U, m, N] on the features' device and the host array the loop reads, one memory on the
    CPU), with `slot` [U, N] (token -> row)."""
    (xn, xf), (rows, host), live = st.xs, st.cache, st.live
    u, n, d = xn.shape
    m = rows.shape[1]
    who = np.flatnonzero(miss)
    q = min(m, int((st.ks[who] - t).max()))
    picks = None
    if mind is not None:  # the first refill's guess goes on, else the last pool, else a new one
        picks = _staged(st, who, s)
        if picks is None and REUSE:
            picks = _reuse(st, who, mind, s, q)
    if picks is None:
        cur = live[who] if mind is None else mind[who] + live[who]  # current scores [U', N]
        mw = None if mind is None else mind[who]
        pool = min(st.pool, 2 * q, n)  # the pool a block needs, less for the last picks
        picks = _predict(st, who, cur, mw, live[who], s[who], q, pool)
        first = STAGE if 5 * pool < n else GUESS
        if mind is None and picks.shape[1] > first:  # a guess: a stage now, more while it holds
            guess, nxt = np.zeros((u, picks.shape[1]), dtype=np.int64), np.full(u, -1, dtype=np.int64)
            guess[who], nxt[who] = picks, first
            st.guess = (guess, nxt, first)
            picks = picks[:, :first]
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
        bmm(a, b.transpose(1, 2), out=rows[at, :q])  # <xn_i, xn_j>: the loops read 1 - it (the same float)
    if host is not None:
        host[who, :q] = rows[torch.from_numpy(who).to(rows.device), :q].cpu().numpy()
    if jit.compiled(xn):
        from trimvlm.kernels.picks import set_slots

        set_slots(st.slot, who, np.ascontiguousarray(picks))
        return
    st.slot[who] = -1
    for j in range(q - 1, -1, -1):  # a token predicted twice (out of candidates) keeps its first row
        st.slot[who, picks[:, j]] = j


def _staged(st, who, s) -> np.ndarray | None:
    """The next stage of the first refill's guess for the units `who` [U'] missing with picks `s` [U], when
    every one of them took the guess so far and its next guessed pick is `s` (twice the last stage's rows, at
    most the rest); else None (and the guess dropped for them)."""
    if st.guess is None:
        return None
    picks, nxt, size = st.guess
    at = int(nxt[who[0]])
    if at < 0 or at >= picks.shape[1] or (nxt[who] != at).any() or (picks[who, at] != s[who]).any():
        nxt[who] = -1
        return None
    size = min(2 * size, picks.shape[1] - at)
    nxt[who] = at + size
    st.guess = (picks, nxt, size)
    return picks[who, at : at + size]


def _gram(c: torch.Tensor) -> np.ndarray:
    """[U', P, P] products <c_i, c_j> of the pool's candidates `c` [U', P, d] (their cosine distances are 1 minus
    them), on the host: the upper block triangle computed (GRAM_BLOCK rows at a time against the columns from
    their own on), the rest mirrored (3/4 of the full product's multiply-adds at P = 512)."""
    p = c.shape[1]
    if not GRAM_BLOCK or p <= GRAM_BLOCK:
        return bmm(c, c.transpose(1, 2)).cpu().numpy()
    g = torch.empty(c.shape[0], p, p, dtype=c.dtype, device=c.device)
    for i in range(0, p, GRAM_BLOCK):
        j = min(p, i + GRAM_BLOCK)
        bmm(c[:, i:j], c[:, i:].transpose(1, 2), out=g[:, i:j, i:])  # written in place (rows of stride P)
        g[:, j:, i:j] = g[:, i:j, j:].transpose(1, 2)
    return g.cpu().numpy()


def _predict(st, who, cur, mind, live, s, q: int, pool: int) -> np.ndarray:
    """[U', c] per unit `who` the picks the rule is certain to make from `s` on (c <= q): the rule run ahead on
    the unit's `pool` best current candidates (by `cur` [U', N]) with their [pool, pool] distances (one counted
    product). A token outside the pool scores at most tau, the best score outside it now (scores only fall),
    so a predicted pick scoring above tau is the rule's own pick; the run stops at the first that does not (at
    step 0, before any distance, nothing beyond `s` is certain). c is the most certain picks of any unit (the
    others' extra rows are guesses). A guess of which rows to compute, nothing more: the caller checks every
    pick."""
    (xn, xf), w = st.xs, len(who)
    n, d = xn.shape[1:]
    if q == 1 or pool <= 1:
        return s[:, None]
    rr = np.arange(w)
    sc = cur.copy()
    sc[rr, s] = np.inf
    tau = np.full(w, -np.inf, dtype=sc.dtype)  # nothing outside the pool (or, at step 0, nothing known)
    if pool < n:
        order = np.argpartition(-sc, pool, axis=1)
        cand = np.sort(order[:, :pool], axis=1)  # index order, as argmax ties
        if mind is not None:
            tau = sc[rr, order[:, pool]]
    else:  # every token (pool is at most N)
        cand = np.tile(np.arange(n), (w, 1))
    flat = torch.from_numpy((who[:, None] * n + cand).reshape(-1)).to(xn.device)
    c = xf.index_select(0, flat).reshape(w, pool, d)
    g = _gram(c)
    for j, unit in enumerate(who.tolist()):
        st.pools[unit] = (cand[j], g[j])
    mc = np.full((w, pool), np.inf, dtype=g.dtype) if mind is None else np.take_along_axis(mind, cand, 1)
    lc = np.take_along_axis(live, cand, 1)
    return _run_ahead(xn, g, mc, lc, (cand == s[:, None]).argmax(1), cand, tau, s, q)


def _reuse(st, who, mind, s, q: int) -> np.ndarray | None:
    """The picks the rule is certain to make from `s` on for the units `who`, from the pools their last
    `_predict` kept (candidates and products) with the current scores: a token outside a pool now scores at most
    tau, the best score outside it, so the same certainty holds (`_predict`). None (a new pool is needed) when a
    unit has no pool, the pools differ in size, a pick `s` is not among its pool's candidates, or the run is
    shorter than REUSE_MIN (or q)."""
    kept = [st.pools.get(unit) for unit in who.tolist()]
    if any(k is None for k in kept) or len({k[0].shape[0] for k in kept}) != 1:
        return None
    cand, g = np.stack([k[0] for k in kept]), np.stack([k[1] for k in kept])
    at = cand == s[who][:, None]
    if not at.any(1).all():
        return None
    outside = mind[who] + st.live[who]
    np.put_along_axis(outside, cand, -np.inf, 1)
    mc, lc = np.take_along_axis(mind[who], cand, 1), np.take_along_axis(st.live[who], cand, 1)
    picks = _run_ahead(st.xs[0], g, mc, lc, at.argmax(1), cand, outside.max(1), s[who], q)
    return picks if picks.shape[1] >= min(q, REUSE_MIN) else None


def _run_ahead(xn, g, mc, lc, pos, cand, tau, s, q: int) -> np.ndarray:
    """The rule run ahead on each unit's pool (`_predict`): g [W, P, P] products, mc / lc [W, P] running min and
    liveness of the candidates cand [W, P], pos [W] the place of the current pick s [W], tau [W] the best score
    outside; [W, c] picks while some unit's are certain (compiled or numpy)."""
    w = len(s)
    rr = np.arange(w)
    out = np.empty((w, q), dtype=np.int64)
    out[:, 0] = s
    if jit.compiled(xn):
        from trimvlm.kernels.picks import predict_run

        return out[:, : predict_run(g, mc, lc, pos, cand, tau.astype(g.dtype), out)]
    sure = np.ones(w, dtype=bool)
    for j in range(1, q):
        np.minimum(mc, 1.0 - g[rr, pos], out=mc)
        lc[rr, pos] = -np.inf
        v = mc + lc
        pos = v.argmax(1)
        sure &= v[rr, pos] > tau
        if not sure.any():
            return out[:, :j]
        out[:, j] = cand[rr, pos]
    return out
