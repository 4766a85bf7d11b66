"""FasterVLM: keep the visual tokens the vision tower's [CLS] token attends to most, before the LLM."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.kernels.select import topk_mask
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, VisionAttentionReducer, VisualView


@register("tokens", "fastervlm")
@dataclass
class FasterVLM(VisionAttentionReducer):
    """FasterVLM (Zhang et al., "[CLS] Attention is All You Need for Training-Free Visual Token Pruning: Make
    VLM Inference Faster", arXiv 2412.01818v1, 2024), at LLM layer L = 0.

    Score of patch j: the [CLS] attention a_j = (1/H) sum_h softmax_j(q_[CLS]^h k_j^h / sqrt(d)) in the vision
    tower's penultimate layer (`vision_layer`, default -2, the layer LLaVA takes its features from); each image
    keeps its K = ceil(N * keep) patches of largest a_j and drops the rest, no merge. The paper prunes the vision
    features before the projector; selecting the projector's outputs at L = 0 keeps the same tokens (LLaVA's
    projector maps each patch to one token on its own).

    Headline (the paper's abstract): FasterVLM prunes 95 % of the visual tokens while keeping 90 % of the
    performance of LLaVA-1.5-7B, where the methods that rank by the LLM's text-visual attention (FastV) fall
    further at high reduction ratios.

    Towers without [CLS] (Qwen-VL, SigLIP in LLaVA and Idefics3): a_j is the mean attention patch j receives
    from the image's patches (column mean of the softmax, heads averaged), the [CLS]-free score VisionZip and
    PruMerge's follow-ups use; an LLM token made of several patches (Qwen-VL's 2 x 2 merge, pixel shuffles)
    scores their sum. Options: `keep`/`prune`, `vision_layer`; `merge=true` merges the dropped tokens into the
    most similar kept one (off: the paper drops them)."""

    def choose(self, view: VisualView) -> Selection:
        return Selection(keep=topk_mask(view.attention, view.k, view.mask))
