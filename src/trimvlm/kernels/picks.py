"""The compiled per-pick loops (numba; `kernels.jit`): one pass over the tokens per pick where the array code
makes several, with numpy's / torch's rules kept exactly (argmax: the first NaN, else the first maximum;
minimum: NaN propagates), so the picks are the fallback's bit for bit. The matrix products they read are
computed by the callers (torch, counted); these loops only do the O(N) work between products."""

from __future__ import annotations

import numpy as np

from trimvlm.kernels.jit import njit

LANES = 16  # independent running maxima: a scan of one max is a chain of dependent compares, 16 of them vectorise


@njit
def argmax_sum(a, b):
    """argmax(a + b) of two 1-D arrays as numpy's: the first NaN if there is one, else the first maximum. Three
    passes that vectorise (the max in LANES lanes, then the first sum equal to it, LANES at a time; the sums
    recomputed, the same floats) in place of one scan whose every step waits for the last."""
    n = a.shape[0]
    acc = np.full(LANES, -np.inf, dtype=a.dtype)
    nan = False
    i = 0
    while i + LANES <= n:
        for j in range(LANES):
            v = a[i + j] + b[i + j]
            nan |= v != v
            acc[j] = v if v > acc[j] else acc[j]
        i += LANES
    best = acc[0]
    for j in range(1, LANES):
        best = acc[j] if acc[j] > best else best
    for e in range(i, n):
        v = a[e] + b[e]
        nan |= v != v
        best = v if v > best else best
    if nan:
        for e in range(n):
            v = a[e] + b[e]
            if v != v:
                return e
    i = 0
    while i + LANES <= n:  # the block holding the first maximum (+0 and -0 are equal, as to `>`)
        hit = False
        for j in range(LANES):
            hit |= a[i + j] + b[i + j] == best
        if hit:
            break
        i += LANES
    for e in range(i, n):
        if a[e] + b[e] == best:
            return e
    return 0  # every sum -inf: numpy's argmax is the first


@njit
def _fold_argmax(row, mind, live, near, t, track):
    """mind <- min(mind, 1 - row) (row: the pick's products, so 1 - row its distances; NaN propagates; near[i] =
    t where the distance < mind) in one pass that vectorises, then argmax(mind + live) (`argmax_sum`)."""
    one = mind.dtype.type(1)
    for i in range(mind.shape[0]):
        d, m = one - row[i], mind[i]
        lt = d < m
        if track:
            near[i] = t if lt else near[i]
        mind[i] = d if (lt or d != d) else m
    return argmax_sum(mind, live)


@njit
def fps_advance(rows, slot, mind, live, near, ks, s, tt, out, kmax, track, units):
    """Farthest point's loop (`kernels.farthest`) for each unit of `units`, from its step tt[u] and pick s[u]:
    record the pick, fold its cached row rows[u, slot[u, s]] into the running min `mind` (and the
    nearest pick's step `near`), take the next pick argmax(mind + live); until the unit is done (tt[u] = kmax)
    or its pick has no cached row (a miss: tt[u], s[u] left at that step for the caller to refill and call
    again; recording the pick twice is harmless). The rows hold products: a distance is 1 - product (the float
    the array code computes). A unit past its k[u] stops updating `mind`."""
    one = mind.dtype.type(1)
    for u in units:
        t, su = tt[u], s[u]
        while t < kmax:
            out[u, t] = su
            live[u, su] = -np.inf
            last = t == kmax - 1
            if last and not track:
                t = kmax
                break
            if t < ks[u]:
                a = slot[u, su]
                if a < 0:
                    break
                if t == 0:
                    for i in range(mind.shape[1]):
                        mind[u, i] = one - rows[u, a, i]
                elif not last:  # fold the row in and take the next pick in one pass
                    su = _fold_argmax(rows[u, a], mind[u], live[u], near[u] if track else near[0], t, track)
                    t += 1
                    continue
                else:
                    _fold_argmax(rows[u, a], mind[u], live[u], near[u] if track else near[0], t, track)
            elif t == 0:
                mind[u] = np.inf
            if last:
                t = kmax
                break
            su = argmax_sum(mind[u], live[u])
            t += 1
        tt[u], s[u] = t, su


@njit
def set_slots(slot, who, picks):
    """Farthest point's cache map after a refill: slot[u] = -1, then slot[u, picks[r, j]] = j for the units
    u = who[r], the first j where a token was predicted twice."""
    for r in range(who.shape[0]):
        u = who[r]
        slot[u] = -1
        for j in range(picks.shape[1] - 1, -1, -1):
            slot[u, picks[r, j]] = j


@njit
def predict_run(g, mc, lc, pos, cand, tau, out):
    """Farthest point's look-ahead (`kernels.farthest._predict`) on each unit's candidate pool: g [W, P, P]
    products (distances 1 - g), mc / lc [W, P] running min and liveness, pos [W] the current pick's place,
    cand [W, P] tokens, tau [W] the best score outside the pool; writes out[:, 1:] (out[:, 0] is the current
    pick) while some unit's run is certain (its picks score above tau) and returns how many columns it wrote
    (the numpy loop's rule)."""
    w, q = out.shape
    pool = mc.shape[1]
    one = mc.dtype.type(1)
    done = 1
    for r in range(w):
        p = pos[r]
        sure = q
        for j in range(1, q):
            for i in range(pool):  # a select, not a branch: it vectorises
                v, m = one - g[r, p, i], mc[r, i]
                mc[r, i] = v if (v < m or v != v) else m
            lc[r, p] = -np.inf
            p = argmax_sum(mc[r], lc[r])
            out[r, j] = cand[r, p]
            if sure == q and not mc[r, p] + lc[r, p] > tau[r]:
                sure = j
        done = max(done, sure)
    return done


@njit
def _gain(d2, floor, fallback):
    """A DPP candidate's score: its gain d2, or `fallback` once the gain is rounding noise (not above `floor`)."""
    return d2 if (d2 > floor or np.isinf(d2)) else fallback


@njit
def dpp_first(d2, floor, fallback, j):
    """The DPP's first pick of every unit into j [U]."""
    gain, zeros = np.empty(d2.shape[1], dtype=d2.dtype), np.zeros(d2.shape[1], dtype=d2.dtype)
    for u in range(d2.shape[0]):
        for i in range(d2.shape[1]):
            gain[i] = _gain(d2[u, i], floor[u, i], fallback[u, i])
        j[u] = argmax_sum(gain, zeros)


@njit
def dpp_step(t, k, j, picks, quality, row, cprod, d2, floor, fallback, c, tiny, xn, xj, cj):
    """Pick t of CDPruner's greedy DPP (`tokens.cdpruner.dpp_greedy`) for every unit, from its kernel row
    row [U, N] = <x_j, x_i> and cprod [U, N] = <c_j, c_i> (ignored at t = 0): record j, the Cholesky column
    e_i = (q_j row_i q_i - cprod_i) / sqrt(max(d2_j, tiny)) into c[:, t], d2 -= e^2, then the next pick into j
    with its feature row gathered into xj [U, 1, D] and its column c[u, :t + 1, j] into cj (flat, [U, t + 1])."""
    u_n, n = d2.shape
    zero = d2.dtype.type(0)
    gain, zeros = np.empty(n, dtype=d2.dtype), np.zeros(n, dtype=d2.dtype)
    for u in range(u_n):
        jj = j[u]
        active = t < k[u]
        picks[u, t] = jj if (active or t == 0) else picks[u, t - 1]
        qj, dj = quality[u, jj], d2[u, jj]
        den = np.sqrt(tiny if dj < tiny else dj)
        real = active and dj > floor[u, jj]
        for i in range(n):
            e = zero
            if real:
                lj = qj * row[u, i] * quality[u, i]
                if t:
                    lj = lj - cprod[u, i]
                e = lj / den
            c[u, t, i] = e
            d2[u, i] = d2[u, i] - e * e
            gain[i] = _gain(d2[u, i], floor[u, i], fallback[u, i])
        d2[u, jj] = gain[jj] = -np.inf
        nj = argmax_sum(gain, zeros)
        j[u] = nj
        xj[u, 0] = xn[u, nj]
        for r in range(t + 1):
            cj[u * (t + 1) + r] = c[u, r, nj]


@njit
def top_share(sim, keep, mask, share):
    """DART's duplicate pass (`tokens.dart`): for every unit u and pivot j in order, keep the share[u, j]
    tokens least similar to pivot j (sim [U, N, P]) among the real tokens not kept yet, as `kernels.select.
    topk_mask(-sim[:, :, j], share, mask & ~keep)` does: rank all N scores (-sim; NaN and the tokens that are
    not candidates at -inf) high to low, ties to the lower index, keep the candidates ranked below the share."""
    u_n, n, p_n = sim.shape
    v = np.empty(n, dtype=sim.dtype)
    for u in range(u_n):
        for j in range(p_n):
            s = share[u, j]
            if s <= 0:
                continue
            for i in range(n):
                x = -sim[u, i, j]
                v[i] = -np.inf if (x != x or not mask[u, i] or keep[u, i]) else x
            if s >= n:
                for i in range(n):
                    keep[u, i] |= mask[u, i]
                continue
            thr = np.partition(v, n - s)[n - s]  # the share-th highest score
            above = 0
            for i in range(n):
                above += v[i] > thr
            ties = s - above  # how many of the scores equal to it make the cut, lowest index first
            for i in range(n):
                cand = mask[u, i] and not keep[u, i]
                if v[i] > thr:
                    keep[u, i] |= cand
                elif v[i] == thr and ties > 0:
                    ties -= 1
                    keep[u, i] |= cand
