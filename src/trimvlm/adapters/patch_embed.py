"""A patch embedding whose convolution sees one patch per input, run as the matrix product it is.

The Qwen-VL towers embed patches that the image processor has already cut out: each row of `pixel_values` is
one patch, viewed as [C, T, P, P] and passed through a `Conv3d` whose kernel and stride are [T, P, P], so every
output is the dot product of one flattened patch with one flattened filter. On a CPU, torch runs that
convolution several times slower than the same product as a `linear`. `as_matmul(conv)` runs the product instead
while its context is open (reference-counted over overlapping contexts): same weights (viewed, not copied), same
FLOPs (torch's counter counts 2 x patches x filter size x filters for both), and the same values up to the order
of the sums (within about 1e-6). An input whose spatial size is not the kernel's, a padded or dilated or grouped
convolution, runs the convolution itself.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from trimvlm.runtime.held import Held


def _one_patch(conv: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `conv` maps each input of `x` to a single output position (input size == kernel == stride)."""
    k = tuple(conv.kernel_size)
    return (
        x.dim() == len(k) + 2
        and tuple(x.shape[2:]) == k
        and tuple(conv.stride) == k
        and conv.groups == 1
        and all(p == 0 for p in conv.padding)
        and all(d == 1 for d in conv.dilation)
    )


_HELD = Held()  # per convolution: the matrix-product forward while contexts are open


def as_matmul(conv: torch.nn.Module | None):
    """Inside: `conv` (a Conv1d/2d/3d) runs one-patch inputs as a matrix product; the module's own forward is
    back when the last context on it closes (`runtime.held`), so overlapping contexts (threads running one model)
    keep the product until all have left. `None`, a module that is not a convolution, or one whose instance
    already carries its own `forward`: nothing changes."""
    if not isinstance(conv, torch.nn.modules.conv._ConvNd):
        return contextlib.nullcontext()

    def change():
        if "forward" in vars(conv):  # someone else's forward on the instance: left as it is
            return lambda: None
        own = type(conv).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not _one_patch(conv, x):
                return own(conv, x)
            weight = conv.weight.reshape(conv.out_channels, -1)
            out = F.linear(x.reshape(x.shape[0], -1), weight, conv.bias)
            return out.view(*out.shape, *([1] * (x.dim() - 2)))

        conv.forward = forward
        return lambda: vars(conv).pop("forward")

    return _HELD.holding(id(conv), change)
