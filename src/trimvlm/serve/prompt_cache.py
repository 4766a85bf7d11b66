"""Prompt reuse for chat completions: a prompt prefilled once is not prefilled again (vLLM's automatic prefix
caching, for whole prompts), through the runner's prefix cache (runtime/prefix_cache.py, `--prefix-cache-mb`).

A chat request's prompt (its token ids and each image by its pixel content, never a placeholder) and the plan's
label key an entry: the KV and recurrent states its prefill left (one row, padding removed: `take_row`) and the
logits of its last token, from which the first token is chosen (greedy or the request's own seeded draw, as
before). A request whose prompt is found runs no vision tower and no prefill: its row is assembled from the
entry (left-padded as a batch: `assemble`) and joins the decode batch; the found and the prefilled rows of one
admission are assembled together. Exact: the entry is what that prompt's prefill computed (to float rounding,
as a change of batch is; the tests compare the answers with and without the cache). Costs are what ran: a
found prompt has no vision or prefill FLOPs (`usage.prefix_reused`, `prefix_tokens_reused`).

Not for a plan whose KV step runs at the prefill/decode boundary (a `kv=` policy keeps state of its own for the
decode) or with a per-sample layer plan: those prefill every prompt, as before.
"""

from __future__ import annotations

import torch

from trimvlm.runtime.lru import digest
from trimvlm.runtime.prefix_cache import assemble, take_row
from trimvlm.runtime.runner import PrefillOutput


def reusable(plan) -> bool:
    return plan.after_prefill is None and not plan.per_sample


def prompt_key(label: str, prepared) -> bytes:
    """What a request's prefill reads (a batch of one, unpadded) and the recipe it runs with."""
    inputs = prepared.model_inputs
    return digest("chat", label, prepared.input_ids, prepared.attention_mask,
                  *(x for k in sorted(inputs) for x in (k, inputs[k])))  # fmt: skip


def prefill(runner, parts: list, plan, meter, keys: list | None = None) -> tuple[PrefillOutput, list[bool]]:
    """The prefill of the requests `parts` (each prepared alone) as one batch, found prompts read from the
    cache, the others prefilled together (and stored); (the output, per request whether it was found). `keys`:
    their `prompt_key`s with the plan's label, when the preparation made them (None: made here)."""
    cache = runner.prefix_cache
    if cache is None or not reusable(plan):
        return runner.prefill(runner.adapter.collate(parts), plan, meter=meter), [False] * len(parts)
    keys = [
        k if k is not None else prompt_key(plan.label(), p)
        for k, p in zip(keys or [None] * len(parts), parts, strict=True)
    ]
    found = [cache.get(k) for k in keys]
    todo = [i for i, f in enumerate(found) if f is None]
    out = None
    if todo:
        prepared = runner.adapter.collate([parts[i] for i in todo])
        out = runner.prefill(prepared, plan, meter=meter)
        for b, i in enumerate(todo):
            entry = take_row(out, b, prepared.n_images[b], int(parts[i].attention_mask.sum()))
            found[i] = (entry, out.logits[b : b + 1].clone())
            cache.put(keys[i], found[i], entry.nbytes + found[i][1].nbytes)
    hits = [i not in todo for i in range(len(parts))]
    if len(todo) == len(parts):
        return out, hits  # all prefilled now: their batch as it is
    rows = assemble([e for e, _ in found], runner.num_layers)
    logits = torch.cat([lg for _, lg in found])
    return PrefillOutput(logits=logits, seq=rows.seq, cache=rows.cache, next_pos=rows.next_pos), hits
