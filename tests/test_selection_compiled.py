"""Every compiled per-pick loop (farthest point and its look-ahead, CDPruner's greedy DPP) makes the
picks of the numpy / torch loop it replaces, bit for bit, on random inputs of several N, d and keep, with ties
and N = 1; the method FLOPs are the same whichever loop ran; samples on two threads give the one-thread result."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trimvlm.kernels import flops, jit, threads
from trimvlm.kernels.density import farthest_point, masked_minmax
from trimvlm.tokens.cdpruner import dpp_greedy

pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed: only the fallback exists")

# (sizes of the units, feature width, kept fraction)
SHAPES = [([1], 8, 1.0), ([1, 5, 3], 4, 0.5), ([40, 25, 33], 16, 0.3), ([300, 130], 32, 0.2), ([400], 24, 0.4)]


class Meter:
    def __init__(self):
        self.flops = 0

    def add_method(self, phase, f):
        self.flops += f


def units(sizes, d, seed, dtype=torch.float32, ties=False):
    """Padded features [U, N, d], mask, and a rho-like tilt; `ties`: features drawn from a few repeated rows and
    a tilt of a few levels, so many distances and scores tie exactly."""
    g = torch.Generator().manual_seed(seed)
    nmax = max(sizes)
    x = torch.zeros(len(sizes), nmax, d, dtype=dtype)
    tilt = torch.zeros(len(sizes), nmax, dtype=dtype)
    mask = torch.zeros(len(sizes), nmax, dtype=torch.bool)
    for u, n in enumerate(sizes):
        if ties:
            base = torch.randn(3, d, dtype=dtype, generator=g)
            x[u, :n] = base[torch.randint(0, 3, (n,), generator=g)]
            tilt[u, :n] = torch.randint(0, 2, (n,), generator=g).to(dtype)
        else:
            x[u, :n] = torch.randn(n, d, dtype=dtype, generator=g)
            tilt[u, :n] = torch.rand(n, dtype=dtype, generator=g)
        mask[u, :n] = True
    return x, mask, masked_minmax(tilt, mask).masked_fill(~mask, 0.0)


def both(fn):
    """fn() with the compiled loops and with the fallback, each with its method FLOPs."""
    out = []
    for off in (False, True):
        meter = Meter()
        with flops.counting(meter, "prefill"), jit.switched(not off):
            assert jit.compiled() is not off
            out.append((fn(), meter.flops))
    return out


def keeps(sizes, keep):
    return torch.tensor([max(1, int(np.ceil(n * keep))) for n in sizes])


@pytest.mark.parametrize("sizes, d, keep", SHAPES)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("block", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_farthest_point_compiled_equals_fallback(sizes, d, keep, ties, block, dtype):
    x, mask, tilt = units(sizes, d, seed=len(sizes) * 7 + d, dtype=dtype, ties=ties)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    k = keeps(sizes, keep)
    for track in (False, True):
        (a, fa), (b, fb) = both(
            lambda track=track: farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=track, block=block)
        )
        assert torch.equal(a[0], b[0]) and fa == fb and (fa > 0 or (int(k.max()) == 1 and not track))
        if track:
            assert torch.equal(a[1], b[1])
        for u, n in enumerate(sizes):  # every pick a real token, none twice
            p = a[0][u, : int(k[u])].tolist()
            assert len(set(p)) == len(p) and max(p) < n


def test_farthest_point_compiled_on_one_token_and_past_the_tokens():
    """N = 1, and a unit asked for more picks than it has tokens (the numpy loop's rule: the rest repeat index
    0 on -inf scores): the same output from both."""
    x, mask, tilt = units([1, 6], 4, seed=3)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    for k in ([1, 1], [1, 6], [3, 6], [4, 2], [0, 3]):
        (a, fa), (b, fb) = both(
            lambda k=k: farthest_point(xn, mask, torch.tensor(k), tilt, tilt.argmax(1), track_nearest=True)
        )
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and fa == fb
    (a, _), (b, _) = both(lambda: farthest_point(xn[:1], mask[:1], torch.tensor([1]), tilt[:1], tilt[:1].argmax(1)))
    assert a[0].tolist() == b[0].tolist() == [[0]]


def products_counted(monkeypatch, n: int) -> list[tuple[str, int]]:
    """Every farthest-point product in order: ("rows", rows against all `n` tokens) or ("pool", its candidates)."""
    from trimvlm.kernels import farthest

    seen, real_bmm = [], farthest.bmm

    def counted(a, b, **kw):
        seen.append(("rows", a.shape[0] * a.shape[1]) if b.shape[-1] == n else ("pool", a.shape[1]))
        return real_bmm(a, b, **kw)

    monkeypatch.setattr(farthest, "bmm", counted)
    return seen


def rows_of(seen: list[tuple[str, int]]) -> list[int]:
    """The rows of every product against all tokens, in order, from `products_counted`."""
    return [r for kind, r in seen if kind == "rows"]


def assert_formula_picks(picks, xn, tilt, k, sizes) -> None:
    """Each unit's picks are the formula's: full distance matrix, one step per pick."""
    for u, n in enumerate(sizes):
        dist = 1.0 - xn[u, :n] @ xn[u, :n].T
        ref = [int(tilt[u, :n].argmax())]
        mind = dist[ref[0]].clone()
        while len(ref) < int(k[u]):
            score = mind + tilt[u, :n]
            score[ref] = float("-inf")
            ref.append(int(score.argmax()))
            mind = torch.minimum(mind, dist[ref[-1]])
        assert picks[u, : int(k[u])].tolist() == ref


def test_farthest_point_certain_refills_compiled_equal_fallback_and_the_formula(monkeypatch):
    """Refills of the picks the look-ahead is certain of, over several blocks in a ragged batch (one unit past
    three blocks of picks, one below one): compiled == fallback with the same FLOPs, the picks are the
    formula's, and only the first refill (before any distance is known) computes rows that go unused."""
    from trimvlm.kernels import farthest

    sizes = [4 * farthest.BLOCK + 40, 300]
    x, mask, tilt = units(sizes, 8, seed=21, dtype=torch.float64)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    k = torch.tensor([3 * farthest.BLOCK + 20, 90])
    seen = products_counted(monkeypatch, x.shape[1])
    (a, fa), (b, fb) = both(lambda: farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=True))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and fa == fb
    rows = rows_of(seen)
    half = len(rows) // 2  # the compiled run's products, then the fallback's
    assert rows[:half] == rows[half:]
    assert rows[0] == 2 * farthest.GUESS  # the first refill: a guess for both units
    assert sum(rows[1:half]) <= int(k.sum()) - 2  # the others: certain picks only (each unit's first was served)
    assert_formula_picks(a[0], xn, tilt, k, sizes)


def test_farthest_point_first_guess_in_stages_compiled_equal_fallback_and_the_formula(monkeypatch):
    """Where the look-ahead pool holds under a fifth of the tokens, the first refill's guess is computed in
    stages (STAGE rows, then twice as many while it holds): compiled == fallback with the same products and
    FLOPs, the picks are the formula's, and the first product has one stage of rows per unit, not a block."""
    from trimvlm.kernels import farthest

    monkeypatch.setattr(farthest, "STAGE", 4)
    sizes, k = [300, 210], torch.tensor([70, 45])
    x, mask, tilt = units(sizes, 8, seed=5, dtype=torch.float64)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    seen = products_counted(monkeypatch, x.shape[1])
    (a, fa), (b, fb) = both(lambda: farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=True, block=16))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and fa == fb
    rows = rows_of(seen)
    half = len(rows) // 2
    assert rows[:half] == rows[half:]
    assert rows[:2] == [2 * 4, 2 * 8]  # pool 32 < 300 / 5: stages of 4, then 8 rows per unit (the guess held)
    assert_formula_picks(a[0], xn, tilt, k, sizes)


def test_farthest_point_refill_reuses_the_last_pool(monkeypatch):
    """A refill whose pick is among its unit's last pool takes the picks it is certain of from that pool's products
    when the run is long enough (REUSE_MIN), instead of a new pool product: compiled == fallback with the same
    products, the picks are the formula's either way, and fewer pool products are made than without reuse."""
    from trimvlm.kernels import farthest

    monkeypatch.setattr(farthest, "GUESS", 4)
    monkeypatch.setattr(farthest, "REUSE_MIN", 1)
    sizes, k = [90, 70], torch.tensor([40, 30])
    x, mask, tilt = units(sizes, 8, seed=1, dtype=torch.float64)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    pools = {}
    for reuse in (True, False):
        monkeypatch.setattr(farthest, "REUSE", reuse)
        seen = products_counted(monkeypatch, x.shape[1])
        (a, fa), (b, fb) = both(lambda: farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=True, block=16))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and fa == fb
        half = len(seen) // 2
        assert seen[:half] == seen[half:]
        assert seen[:2] == [("pool", 32), ("rows", 2 * 4)]  # pool 32 >= 90 / 5: a guess of GUESS rows per unit
        assert_formula_picks(a[0], xn, tilt, k, sizes)
        pools[reuse] = sum(kind == "pool" for kind, _ in seen[:half])
    assert pools[True] < pools[False]


def test_farthest_point_compiled_matches_the_formula():
    """Against the plain formula (full distance matrix, one step per pick), float64, no ties."""
    x, mask, tilt = units([50, 37], 8, seed=5, dtype=torch.float64)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    k = torch.tensor([20, 11])
    picks, _ = farthest_point(xn, mask, k, tilt, tilt.argmax(1))
    for u, n in enumerate((50, 37)):
        dist = 1.0 - xn[u, :n] @ xn[u, :n].T
        ref = [int(tilt[u, :n].argmax())]
        mind = dist[ref[0]].clone()
        while len(ref) < int(k[u]):
            score = mind + tilt[u, :n]
            score[ref] = float("-inf")
            ref.append(int(score.argmax()))
            mind = torch.minimum(mind, dist[ref[-1]])
        assert picks[u, : int(k[u])].tolist() == ref


@pytest.mark.parametrize("sizes, d, keep", SHAPES + [([30, 20], 4, 0.9)])  # the last: more picks than rank
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dpp_greedy_compiled_equals_fallback(sizes, d, keep, ties, dtype):
    x, mask, tilt = units(sizes, d, seed=len(sizes) + d, dtype=dtype, ties=ties)
    xn = F.normalize(x, dim=-1, eps=1e-12).masked_fill(~mask[..., None], 0.0)
    quality = (tilt + 0.1).masked_fill(~mask, 0.0)
    k = keeps(sizes, keep)
    (a, fa), (b, fb) = both(lambda: dpp_greedy(xn, quality, mask, k))
    assert torch.equal(a, b) and fa == fb and fa > 0


@pytest.mark.parametrize(
    "recipe",
    ["density", "density:merge=false", "density:size_weighted=true", "divprune:merge=true", "cdpruner",
     "dart:pivot=hidden:pivots=3"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reducers_compiled_equal_fallback_with_the_same_flops(recipe, dtype, monkeypatch):
    """The whole reduction on a ragged batch (tests/test_selection_batched.py's, its tokens grouping 1-4 tokens
    each already, so a size-weighted merge weighs them): same kept tokens, merged hidden states (the compiled
    fold, `kernels.fold`) and sizes bit for bit, same method FLOPs."""
    from test_selection_batched import GRIDS, ragged_seq

    from trimvlm.plan import Handoff, build_methods

    def seq():
        s = ragged_seq(GRIDS, seed=2)
        s.hidden = s.hidden.to(dtype)
        s.size = torch.randint(1, 5, s.size.shape, generator=torch.Generator().manual_seed(3))
        return s

    from trimvlm.kernels import fold

    folds = []
    real = fold.Receivers.fold
    monkeypatch.setattr(fold.Receivers, "fold", lambda self, *a: folds.append(self.weighted) or real(self, *a))
    red = build_methods(f"tokens={recipe}:keep=0.3:layer=0")["tokens"]
    (a, fa), (b, fb) = both(lambda: red.reduce(seq(), None, Handoff()))
    assert torch.equal(a.source, b.source) and torch.equal(a.valid, b.valid) and torch.equal(a.size, b.size)
    assert torch.equal(a.hidden, b.hidden) and fa == fb and fa > 0
    merges = recipe.startswith(("density", "divprune")) and "merge=false" not in recipe
    assert folds == ([] if not merges else [recipe.endswith("size_weighted=true")])  # the compiled run's fold


def test_two_threads_give_the_one_thread_picks(monkeypatch):
    """Samples split over two threads (every chunk size allowed): the same picks and nearest picks."""
    monkeypatch.setattr(jit, "ENABLED", True)
    x, mask, tilt = units([300, 260, 280, 120, 90], 16, seed=9)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    k = keeps([300, 260, 280, 120, 90], 0.25)
    before = torch.get_num_threads()
    one = farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=True)
    monkeypatch.setattr(threads, "MIN_WORK", 0)
    calls = []
    real = threads.for_units

    def spy(fn, todo, work):
        calls.append(len(todo))
        return real(fn, todo, work)

    monkeypatch.setattr("trimvlm.kernels.farthest.for_units", spy)
    try:
        torch.set_num_threads(2)
        two = farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert calls[0] == 5  # the first pass runs all five units, split over the threads


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 5, 7, 16), (3, 6, 4, 12), (1, 24, 24, 64)])
@pytest.mark.parametrize("window", [1, 3, 5])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_density_windows_equal_the_box_sum_to_rounding(shape, window, masked, dtype):
    """Spatial density's fused windows (kernels.windows) against the torch box sum and dot: rho to rounding, 0
    off the mask, 1 without neighbours, the same method FLOPs."""
    from trimvlm.kernels.density import spatial_density

    g = torch.Generator().manual_seed(sum(shape) + window)
    x = torch.randn(*shape, dtype=dtype, generator=g)
    mask = torch.rand(shape[:3], generator=g) > 0.3 if masked else None
    (a, fa), (b, fb) = both(lambda: spatial_density(x, window, mask=mask))
    assert a.dtype == b.dtype and a.shape == b.shape and fa == fb
    eps = torch.finfo(dtype).eps
    assert torch.allclose(a, b, rtol=0, atol=8 * eps)
    if mask is not None:
        assert not a[~mask].any()
    if window == 1:
        assert torch.equal(a, b)


def test_half_precision_and_the_switch_take_the_fallback():
    """float16 features (numba's float16 is partial) run the numpy loop; TRIMVLM_JIT=0 / jit.disabled() too."""
    x = F.normalize(torch.randn(1, 20, 8), dim=-1)
    with jit.switched(True):
        assert jit.compiled(x) and not jit.compiled(x.half()) and jit.compiled(x, cpu=True)
    with jit.disabled():
        assert not jit.compiled(x)
    mask, tilt = torch.ones(1, 20, dtype=torch.bool), torch.rand(1, 20)
    half, _ = farthest_point(x.half(), mask, torch.tensor([5]), tilt.half(), tilt.argmax(1))
    assert len(set(half[0].tolist())) == 5


def test_compiled_paths_count_what_torchs_flop_counter_sees():
    """The method line of the compiled farthest point, DPP and density windows equals torch's FlopCounterMode
    over the same call (their products are torch calls; the compiled loops do no multiply-adds of a product)."""
    from torch.utils.flop_counter import FlopCounterMode

    from trimvlm.kernels.density import spatial_density

    x, mask, tilt = units([300, 130], 32, seed=4)
    xn = F.normalize(x, dim=-1, eps=1e-12).masked_fill(~mask[..., None], 0.0)
    k = keeps([300, 130], 0.2)
    calls = [
        lambda: farthest_point(xn, mask, k, tilt, tilt.argmax(1), track_nearest=True),
        lambda: dpp_greedy(xn, tilt + 0.1, mask, k),
        lambda: spatial_density(x[:, :289].reshape(2, 17, 17, 32), 3),
    ]
    for call in calls:
        meter = Meter()
        with flops.counting(meter, "prefill"), FlopCounterMode(display=False) as fc, jit.switched(True):
            call()
        assert meter.flops == fc.get_total_flops() > 0


@pytest.mark.parametrize("seed", range(6))
def test_dart_duplicate_pass_compiled_equals_the_topk_loop(seed):
    """DART's pass per pivot (kernels.picks.top_share) against the torch loop of topk_mask: ties (few distinct
    similarities, -0.0 and 0.0), NaN, pads, shares of 0, past the candidates and past N."""
    from trimvlm.kernels.picks import top_share
    from trimvlm.kernels.select import topk_mask

    g = torch.Generator().manual_seed(seed)
    u, n, p = 5, 37, 4
    sim = torch.randint(-3, 4, (u, n, p), generator=g).float() / 3  # many exact ties
    sim[sim == 0] = torch.where(torch.rand(int((sim == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    sim[torch.rand(u, n, p, generator=g) < 0.05] = float("nan")
    mask = torch.rand(u, n, generator=g) < 0.85
    keep0 = mask & (torch.rand(u, n, generator=g) < 0.1)
    shares = torch.randint(0, 12, (u, p), generator=g)
    shares[0, 0], shares[1, 1] = n + 3, 30
    ref = keep0.clone()
    for j in range(p):
        ref |= topk_mask(-sim[:, :, j], shares[:, j], mask & ~ref)
    got = keep0.clone()
    top_share(sim.numpy(), got.numpy(), mask.numpy(), shares.numpy())
    assert torch.equal(got, ref)


@pytest.mark.parametrize("pool", [5, 128, 256, 300, 600])
def test_the_look_ahead_distances_are_the_full_products(pool):
    """The pool's products, computed as their upper block triangle and mirrored, equal c c^T (float64)."""
    from trimvlm.kernels import farthest

    gen = torch.Generator().manual_seed(pool)
    c = F.normalize(torch.randn(2, pool, 16, dtype=torch.float64, generator=gen), dim=-1)
    g = farthest._gram(c)
    assert np.allclose(g, (c @ c.transpose(1, 2)).numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_argmax_sum_is_numpys_argmax_of_the_sum(dtype):
    """The lane-parallel argmax(a + b) the compiled loops use is np.argmax's: the first NaN, else the first
    maximum (+0 and -0 tie), all -inf gives 0; every length around the lane count, ties everywhere."""
    from trimvlm.kernels.picks import LANES, argmax_sum

    rng = np.random.default_rng(0)
    specials = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, 1.0], dtype=dtype)
    for n in [1, 2, LANES - 1, LANES, LANES + 1, 2 * LANES + 3, 100, 1000]:
        for case in range(40):
            a = rng.integers(-3, 3, n).astype(dtype)  # small integers: many exact ties
            b = rng.integers(-3, 3, n).astype(dtype)
            if case % 4 == 1:  # a few special values anywhere
                at = rng.integers(0, n, max(1, n // 10))
                a[at] = rng.choice(specials, len(at))
            elif case % 4 == 2:  # every sum -inf but maybe one
                a[:] = -np.inf
                if case % 8 == 2:
                    a[rng.integers(0, n)] = 0.0
            elif case % 4 == 3:  # signed zeros only: the first one wins
                a[:] = rng.choice(np.array([0.0, -0.0], dtype=dtype), n)
                b[:] = 0.0
            assert argmax_sum(a, b) == np.argmax(a + b), (n, case, a, b)
