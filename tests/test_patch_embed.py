"""A one-patch convolution run as a matrix product (`adapters.patch_embed.as_matmul`): the convolution's values
up to rounding and its FLOPs exactly, the convolution itself for any other input, the module as it was after."""

import contextlib

import pytest
import torch
from conftest import AVAILABLE, ragged_batch

from trimvlm.adapters import patch_embed
from trimvlm.adapters.patch_embed import as_matmul
from trimvlm.runtime.meter import flop_counter


def _flops(fn):
    with flop_counter() as fc:
        out = fn()
    return out, fc.get_total_flops()


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (torch.nn.Conv3d(3, 16, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False), (37, 3, 2, 4, 4)),
        (torch.nn.Conv3d(3, 8, kernel_size=(2, 3, 3), stride=(2, 3, 3), bias=True), (5, 3, 2, 3, 3)),
        (torch.nn.Conv2d(4, 6, kernel_size=5, stride=5, bias=True), (3, 4, 5, 5)),
        (torch.nn.Conv2d(4, 6, kernel_size=1, stride=1, bias=False), (1, 4, 1, 1)),
    ],
)
def test_one_patch_inputs_give_the_convolution_and_its_flops(conv, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    with torch.no_grad():
        want, want_flops = _flops(lambda: conv(x))
        with as_matmul(conv):
            assert "forward" in vars(conv)
            got, got_flops = _flops(lambda: conv(x))
    assert "forward" not in vars(conv)  # the module's own forward is back
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_flops == want_flops > 0


def test_other_inputs_and_convolutions_run_the_convolution():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, kernel_size=4, stride=4)
    padded = torch.nn.Conv2d(3, 4, kernel_size=4, stride=4, padding=1)
    overlapping = torch.nn.Conv2d(3, 4, kernel_size=4, stride=2)
    with torch.no_grad():
        for module, x in [(conv, torch.randn(2, 3, 8, 8)), (padded, torch.randn(2, 3, 4, 4)),
                          (overlapping, torch.randn(2, 3, 4, 4))]:  # fmt: skip
            want = module(x)
            with as_matmul(module):
                assert torch.equal(module(x), want)
    with as_matmul(None), as_matmul(torch.nn.Linear(2, 2)):  # nothing to change
        pass


def test_nested_contexts_keep_the_outer_one():
    conv = torch.nn.Conv3d(1, 2, kernel_size=(1, 2, 2), stride=(1, 2, 2))
    with as_matmul(conv):
        outer = vars(conv)["forward"]
        with as_matmul(conv):
            assert vars(conv)["forward"] is outer
        assert vars(conv)["forward"] is outer
    assert "forward" not in vars(conv)


@pytest.mark.parametrize("family", [f for f in ("qwen2_5_vl", "qwen3_vl", "qwen3_5") if f in AVAILABLE])
def test_the_qwen_towers_embed_as_with_the_convolution(vlms, family, monkeypatch):
    """The Qwen-VL adapters embed their patches through `as_matmul`: the same features (to rounding) and the
    same vision FLOPs as with the tower's own Conv3d."""
    import trimvlm.adapters.qwen3_vl as qwen

    vlm = vlms(family)
    prep = vlm.prepare(*ragged_batch())
    seen = []
    real = patch_embed.as_matmul

    def spy(conv):
        seen.append(conv)
        return real(conv)

    with torch.no_grad():
        monkeypatch.setattr(qwen, "as_matmul", spy)
        got, got_flops = _flops(lambda: vlm.adapter.embed(prep).hidden)
        monkeypatch.setattr(qwen, "as_matmul", lambda conv: contextlib.nullcontext())
        want, want_flops = _flops(lambda: vlm.adapter.embed(prep).hidden)
    assert seen and all(isinstance(c, torch.nn.Conv3d) for c in seen)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got_flops == want_flops


def test_overlapping_contexts_keep_the_product_until_the_last_leaves_and_a_foreign_forward_stays():
    conv = torch.nn.Conv3d(1, 2, kernel_size=(1, 2, 2), stride=(1, 2, 2))
    a, b = as_matmul(conv), as_matmul(conv)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first in leaves first (threads): the second still runs the product
    assert "forward" in vars(conv)
    b.__exit__(None, None, None)
    assert "forward" not in vars(conv)
    mine = conv.forward = lambda x: x  # an instance forward set by someone else is never replaced or removed
    with as_matmul(conv):
        assert vars(conv)["forward"] is mine
    assert vars(conv)["forward"] is mine
