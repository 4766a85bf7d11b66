"""The meta-router's model and DPO objective (issue 11, first part)."""

import copy
import math

import torch

from trimvlm.kernels.flops import counting
from trimvlm.router.dpo import dpo_loss, layout_logprob
from trimvlm.router.model import MetaRouter
from trimvlm.runtime.meter import Meter, flop_counter


def test_dpo_loss_on_hand_made_log_probs_equals_the_closed_form():
    pw, pl = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.5])
    rw, rl = torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -2.0])
    beta = 0.5
    margins = [beta * ((-1.0 + 1.5) - (-3.0 + 2.0)), beta * ((-2.0 + 2.0) - (-1.5 + 2.0))]
    expected = sum(math.log1p(math.exp(-m)) for m in margins) / 2  # -log sigmoid(m) = log(1 + e^-m)
    assert abs(float(dpo_loss(pw, pl, rw, rl, beta)) - expected) < 1e-6


def test_layout_logprob_is_the_bernoulli_log_likelihood_of_the_real_elements():
    s = torch.tensor([[0.9, 0.2, 0.6, 0.5]])
    chosen = torch.tensor([[True, False, True, True]])
    mask = torch.tensor([[True, True, True, False]])
    expected = math.log(0.9) + math.log(0.8) + math.log(0.6)
    assert abs(float(layout_logprob(s, chosen, mask)[0]) - expected) < 1e-6


def _inputs(seed=0, b=3, nv=10, nt=5, d=32):
    g = torch.Generator().manual_seed(seed)
    vis, txt = torch.randn(b, nv, d, generator=g), torch.randn(b, nt, d, generator=g)
    vm = torch.ones(b, nv, dtype=torch.bool)
    tm = torch.ones(b, nt, dtype=torch.bool)
    vm[1, 7:] = False
    tm[2, 3:] = False
    return vis, vm, txt, tm


def test_router_batch_equals_each_input_alone_and_counts_its_flops():
    torch.manual_seed(0)
    router = MetaRouter(32, candidate_layers=[2, 3], width=16, heads=4)
    vis, vm, txt, tm = _inputs()
    meter = Meter()
    with torch.no_grad(), flop_counter() as fc, counting(meter, "prefill"):
        s_v, s_l = router(vis, vm, txt, tm)
    assert meter.costs.method_flops["prefill"] == fc.get_total_flops() > 0
    assert s_v.shape == (3, 10) and s_l.shape == (3, 2)
    assert bool((s_v[~vm] == 0).all()) and bool(((s_l > 0) & (s_l < 1)).all())
    for b in range(3):
        nv, nt = int(vm[b].sum()), int(tm[b].sum())
        with torch.no_grad():
            a_v, a_l = router(vis[b : b + 1, :nv], vm[b : b + 1, :nv], txt[b : b + 1, :nt], tm[b : b + 1, :nt])
        assert torch.allclose(a_v[0], s_v[b, :nv], atol=1e-6) and torch.allclose(a_l[0], s_l[b], atol=1e-6)


def test_one_dpo_step_lowers_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    router = MetaRouter(32, candidate_layers=[2, 3], width=16, heads=4)
    ref = copy.deepcopy(router).requires_grad_(False)
    vis, vm, txt, tm = _inputs(1)
    g = torch.Generator().manual_seed(2)
    win = torch.rand(3, 12, generator=g) < 0.5  # 10 tokens + 2 layers
    lose = ~win
    mask = torch.cat([vm, torch.ones(3, 2, dtype=torch.bool)], dim=1)

    def loss():
        s = torch.cat(router(vis, vm, txt, tm), dim=1)
        with torch.no_grad():
            r = torch.cat(ref(vis, vm, txt, tm), dim=1)
        return dpo_loss(layout_logprob(s, win, mask), layout_logprob(s, lose, mask),
                        layout_logprob(r, win, mask), layout_logprob(r, lose, mask), beta=0.5)  # fmt: skip

    opt = torch.optim.Adam(router.parameters(), lr=1e-2)
    before = loss()
    assert abs(before.detach().item() - math.log(2)) < 1e-6  # router == reference: every margin is 0
    before.backward()
    opt.step()
    assert loss().item() < before.detach().item()
