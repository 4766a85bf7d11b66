"""The Qwen-VL towers' rotary embedding compiled (`kernels.rotary`, `adapters.vision_rotary`): the modeling
module's own function bit for bit, on one thread and split over two, its own function for any call the loop
cannot take, and the module as it was after."""

import importlib
import sys

import pytest
import torch
from conftest import AVAILABLE

from trimvlm.adapters.vision_rotary import NAME, compiled_rotary
from trimvlm.kernels import jit, rotary
from trimvlm.runtime.meter import flop_counter
from trimvlm.testing import random_image

QWEN = [f for f in ("qwen3_vl", "qwen2_5_vl", "qwen3_5") if f in AVAILABLE]
needs_numba = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed: only the fallback exists")


def _inputs(n, heads, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, 3, heads, d, generator=gen)  # strided q and k, as the towers unbind them
    q, k, _ = qkv.unbind(1)
    emb = torch.randn(n, d // 2, generator=gen).repeat(1, 2)
    return q, k, emb.cos(), emb.sin()


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, heads, d", [(1, 1, 2), (7, 3, 8), (1000, 2, 32), (300, 4, 80)])
def test_compiled_rotation_is_the_modules_own_bit_for_bit(monkeypatch, threads, n, heads, d):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod

    monkeypatch.setattr(rotary, "ROWS", 16)  # several blocks, so two threads share the rows
    monkeypatch.setattr(rotary, "MIN_WORK", 1)
    monkeypatch.setattr("trimvlm.kernels.threads.MIN_WORK", 1)
    q, k, cos, sin = _inputs(n, heads, d)
    sin[0, -1] = -sin[0, -1]  # halves of cos / sin that differ are taken as given
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert rotary.usable(q, k, cos, sin)
        got = rotary.rotate(q, k, cos, sin)
    finally:
        torch.set_num_threads(before)
    want = mod.apply_rotary_pos_emb_vision(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_calls_the_loop_cannot_take_are_refused():
    q, k, cos, sin = _inputs(5, 2, 8)
    assert not rotary.usable(q.double(), k.double(), cos.double(), sin.double())  # float32 only
    assert not rotary.usable(q.requires_grad_(), k, cos, sin)
    q, k, cos, sin = _inputs(5, 2, 8)
    assert not rotary.usable(q, k, cos[:, :4], sin[:, :4])
    assert not rotary.usable(q[None], k[None], cos, sin)
    with jit.disabled():
        assert not rotary.usable(q, k, cos, sin)


@pytest.mark.parametrize("family", QWEN)
@torch.no_grad()
def test_encode_equals_the_towers_own_rotation_and_the_module_is_put_back(tiny_adapter, family):
    ad = tiny_adapter(family)
    module = sys.modules[type(ad.inner.visual).__module__]
    own = getattr(module, NAME)
    prep = ad.prepare([[random_image(1, (64, 64))], [random_image(2, (96, 64)), random_image(3)]], ["a", "b"])
    with jit.disabled(), flop_counter() as plain_fc:
        plain = ad.embed(prep).hidden
    with flop_counter() as fc:
        got = ad.embed(prep).hidden
    assert torch.equal(got, plain)
    assert fc.get_total_flops() == plain_fc.get_total_flops()  # element-wise: nothing counted either way
    assert getattr(module, NAME) is own
    seen = []
    with compiled_rotary(ad.inner.visual), compiled_rotary(ad.inner.visual):  # nested: one swap, put back once
        assert getattr(module, NAME) is not own
        real = rotary.rotate
        rotary.rotate = lambda *a: (seen.append(1), real(*a))[1]
        try:
            ad.embed(prep)
        finally:
            rotary.rotate = real
    assert getattr(module, NAME) is own
    assert bool(seen) == jit.AVAILABLE  # the compiled loop ran (where numba is installed)


def test_a_tower_without_the_function_is_left_alone():
    tower = torch.nn.Linear(2, 2)
    with compiled_rotary(tower), compiled_rotary(None):
        pass
    assert not hasattr(importlib.import_module(type(tower).__module__), NAME)
