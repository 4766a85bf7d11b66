"""Downsample: the image itself is made smaller, so the vision tower produces fewer tokens (and costs less)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trimvlm.protocol import register
from trimvlm.tokens.base import TokenReducer


@register("tokens", "downsample")
@dataclass
class Downsample(TokenReducer):
    """Plain image downsampling (VTC-Bench, arXiv 2510.07143: "simply downsampling the image beats many advanced
    methods"; docs/references.md#pooling-and-downsampling): every image is resized (bicubic) before the vision
    tower, so that its grid of LLM tokens, (h, w) at the image's own size, becomes (round(h sqrt(keep)),
    round(w sqrt(keep))): about N * keep tokens, the aspect ratio kept. Nothing is selected inside the model;
    the vision tower runs on the smaller image, so the vision FLOPs fall too (the model's vision line: counted
    by torch's counter on the very encode that ran), and there are no method FLOPs.

    It acts when the batch is prepared (`Plan.resolution`, applied by `vlm.prepare(..., plan=)`; the runner
    refuses a batch prepared without it). Families whose processor gives the token grid from the image's size
    (the Qwen-VL families, dynamic resolution: the resized image is exactly the target grid's pixels and the
    processor's pixel bounds are opened to it) support it; fixed-resolution towers (LLaVA's CLIP / SigLIP at one
    size, InternVL's and Idefics3's fixed tiles) give the same tokens at any size, and are refused.

    Deviations: the kept count is the rounded grid, not the shared K = ceil(N * keep) (the demo's 8 x 8 at 50 /
    25 / 12.5%: 6 x 6 = 36, 4 x 4 = 16, 3 x 3 = 9 of 64); the cost lines show the count that ran. The demo's
    processor pins every image to 8 x 8 (min = max pixels): the bounds are opened for the resized images only.
    `layer` can only be 0."""

    resizes: ClassVar[bool] = True
