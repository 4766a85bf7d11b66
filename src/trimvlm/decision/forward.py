"""The forward of a decision batch: every prompt of every request in one left-padded batch through trimvlm's
runner (the recipe's token reducer and prefill layer plan applied), read at the token before each mark.

What transformers does per prompt (`DecisionPipeline._forward`, `JevForDecision.forward`) is one unbatched
forward of the whole model; here the embedding, the decoder layers and the final norm run once for the batch,
and only the rows read are taken further (no LM head over every position, no decoding: the KV cache the
layers write is dropped after the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.errors import InputError
from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.meter import Meter


@dataclass
class Forward:
    hidden: torch.Tensor  # [M, D] final-normed state at the token before each mark, prompts in batch order
    prepared: object  # the batch (adapters.base.Prepared); None when it went through the prefix cache
    cache: KVCache  # what the layers held at the end of the forward (measured, then dropped)
    layer_flops: int  # the decoder layers' FLOPs (the meter's prefill line before any readout)
    kv_rows: list[int] | None = None  # per request its rows of `cache` (None: one per prompt)
    reuse: object = None  # a shared-prefix forward through the prefix cache: runtime.prefix_cache.PrefixReuse

    @property
    def n_images(self) -> list[int]:
        """Images per row of the prefill (per request with a shared prefix)."""
        return self.reuse.n_images if self.reuse is not None else self.prepared.n_images


@torch.no_grad()
def run_prompts(vlm, prompts: list, plan, meter: Meter) -> Forward:
    """`prompts`: `prompts.Prompt`s. `Runner.prefill` (embed -> layers -> final norm, meter phases vision and
    prefill) without the LM head; the vision tower's FLOPs are counted per request by the caller."""
    prepared = vlm.adapter.prepare_processed([p.inputs for p in prompts])
    out = vlm.runner.prefill(prepared, plan, meter=meter, lm_head=False)
    with meter.timer("prefill"):
        hidden = at_marks(out.seq, prepared, prompts)
    return Forward(hidden=hidden, prepared=prepared, cache=out.cache, layer_flops=meter.costs.flops.get("prefill", 0))


def at_marks(seq, prepared, prompts: list) -> torch.Tensor:
    """[M, D]: row b's state at original index pad_b + mark - 1 of each of its marks (left padding), found by
    provenance (`seq.source`), so it is the same token after a reducer shrank the sequence."""
    length = prepared.input_ids.shape[1]
    rows, targets = [], []
    for b, p in enumerate(prompts):
        pad = length - p.tokens
        rows += [b] * len(p.marks)
        targets += (pad + p.marks - 1).tolist()
    dev = seq.hidden.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
    targets_t = torch.tensor(targets, dtype=torch.long, device=dev)
    hit = seq.source.index_select(0, rows_t) == targets_t[:, None]
    if not bool(hit.any(1).all()):
        raise InputError(
            "the recipe dropped the token a question is read at (the one before its <|mark|>); token reducers "
            "may drop visual tokens only"
        )
    cols = hit.to(torch.int8).argmax(1)
    return seq.hidden[rows_t, cols]
