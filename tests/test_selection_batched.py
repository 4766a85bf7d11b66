"""The batched selection (every image of a ragged batch in one padded call of density, farthest point
and the merge) keeps exactly what a per-sample loop of the plain formulas keeps, and merges to the same values,
with the compiled per-pick loops and with their numpy fallback."""

import math

import pytest
import torch
import torch.nn.functional as F

from trimvlm.kernels import jit
from trimvlm.plan import Handoff, build_methods
from trimvlm.runtime.sequence import LiveSeq
from trimvlm.tokens.base import make_view
from trimvlm.tokens.density import density_select

GRIDS = [(6, 7), (3, 3), (8, 5), (1, 4)]  # ragged: 42, 9, 40 and 4 tokens
TEXT = 3


@pytest.fixture(autouse=True, params=["compiled", "fallback"])
def loops(request):
    """Every test here with the compiled per-pick loops and with the fallback (numba switched off)."""
    if request.param == "compiled" and not jit.AVAILABLE:
        pytest.skip("numba is not installed")
    with jit.switched(request.param == "compiled"):
        yield request.param


def ragged_seq(grids, d=12, seed=0) -> LiveSeq:
    """One image per sample, then TEXT text tokens, left-padded to the longest sample."""
    g = torch.Generator().manual_seed(seed)
    lens = [h * w + TEXT for h, w in grids]
    b, s = len(grids), max(lens)
    hidden = torch.zeros(b, s, d, dtype=torch.float64)
    valid = torch.zeros(b, s, dtype=torch.bool)
    visual = torch.zeros(b, s, dtype=torch.bool)
    source = torch.full((b, s), -1, dtype=torch.long)
    for i, ((h, w), n) in enumerate(zip(grids, lens, strict=True)):
        pad = s - n
        smooth = torch.randn(d, 2, 2, dtype=torch.float64, generator=g)
        base = F.interpolate(smooth[None], size=(h, w), mode="bilinear", align_corners=False)[0]
        feats = base.permute(1, 2, 0).reshape(h * w, d) + 0.3 * torch.randn(
            h * w, d, dtype=torch.float64, generator=g
        )
        hidden[i, pad : pad + h * w] = feats
        hidden[i, pad + h * w :] = torch.randn(TEXT, d, dtype=torch.float64, generator=g)
        valid[i, pad:] = True
        visual[i, pad : pad + h * w] = True
        source[i, pad:] = torch.arange(n)
    return LiveSeq(
        hidden=hidden,
        positions=source.clamp(min=0)[None].expand(3, b, s).clone(),
        valid=valid,
        visual=visual,
        source=source,
        image_id=torch.where(visual, 0, -1),
        grids=[[g_] for g_ in grids],
        image_start=[[0] for _ in grids],
        size=torch.ones(b, s, dtype=torch.long),
    )


def reference(x: torch.Tensor, h: int, w: int, k: int, beta: float):
    """Per sample, straight from the formulas: rho from every window neighbour's cosine, the full distance
    matrix, one Python step per pick; the nearest pick of every token."""
    xn = F.normalize(x, dim=-1, eps=1e-12)
    grid = xn.reshape(h, w, -1)
    rho = torch.zeros(h, w, dtype=x.dtype)
    for i in range(h):
        for j in range(w):
            sims = [grid[i, j] @ grid[a, c] for a in range(max(0, i - 1), min(h, i + 2))
                    for c in range(max(0, j - 1), min(w, j + 2)) if (a, c) != (i, j)]  # fmt: skip
            rho[i, j] = 1.0 - sum(sims) / len(sims) if sims else 1.0
    rho = rho.flatten()
    rt = (rho - rho.min()) / (rho.max() - rho.min()).clamp(min=1e-12)
    dist = 1.0 - xn @ xn.T
    picks = [int(rt.argmax())]
    mind = dist[picks[0]].clone()
    while len(picks) < k:
        score = mind + beta * rt
        score[picks] = float("-inf")
        picks.append(int(score.argmax()))
        mind = torch.minimum(mind, dist[picks[-1]])
    nearest = [picks[i] for i in torch.stack([dist[p] for p in picks]).argmin(0).tolist()]
    return sorted(picks), nearest, rho


@pytest.mark.parametrize("keep", [0.2, 0.5])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_batched_selection_keeps_what_the_per_sample_loop_keeps(keep, beta):
    seq = ragged_seq(GRIDS)
    view = make_view(seq, keep, 0)
    assert view.n.tolist() == [h * w for h, w in GRIDS]
    kept, nearest, rho = density_select(view, beta=beta, window=3, track_nearest=True)
    for u, (h, w) in enumerate(GRIDS):
        n, k = h * w, math.ceil(h * w * keep)
        ref_kept, ref_near, ref_rho = reference(view.features[u, :n], h, w, k, beta)
        assert torch.nonzero(kept[u]).flatten().tolist() == ref_kept
        assert not kept[u, n:].any()
        assert nearest[u, :n].tolist() == ref_near
        assert torch.allclose(rho[u, :n], ref_rho, atol=1e-12)


@pytest.mark.parametrize("recipe", ["density", "density:size_weighted=true", "divprune:merge=true", "cdpruner"])
def test_batched_reduce_equals_each_sample_alone(recipe):
    """The whole reduction (view, selection, merge, gather) on the ragged batch gives each sample the same kept
    sources, merged hidden states and sizes as that sample reduced alone."""
    seq = ragged_seq(GRIDS, seed=1)
    red = build_methods(f"tokens={recipe}:keep=0.3:layer=0")["tokens"]
    out = red.reduce(seq, None, Handoff())
    for b, g in enumerate(GRIDS):
        one = ragged_seq(GRIDS, seed=1)
        cols = one.valid[b]
        alone_in = LiveSeq(
            hidden=one.hidden[b : b + 1, cols], positions=one.positions[:, b : b + 1, cols],
            valid=one.valid[b : b + 1, cols], visual=one.visual[b : b + 1, cols], source=one.source[b : b + 1, cols],
            image_id=one.image_id[b : b + 1, cols], grids=[[g]], image_start=[[0]], size=one.size[b : b + 1, cols],
        )  # fmt: skip
        alone = red.reduce(alone_in, None, Handoff())
        mine = out.valid[b]
        assert out.source[b, mine].tolist() == alone.source[0].tolist()
        assert torch.allclose(out.hidden[b, mine], alone.hidden[0], atol=1e-12, rtol=0)
        assert out.size[b, mine].tolist() == alone.size[0].tolist()
