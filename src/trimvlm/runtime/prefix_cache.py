"""The prefix cache: the KV (and recurrent states) a prefix left in the decoder layers, reused by later requests
with the same prefix, as SGLang's radix cache or vLLM's automatic prefix caching do for their prompts.

A System One request's prompts share a prefix (the state and its images, decision/shared.py) that is prefilled
once and read by every question's tail as a branch, uncopied. With a `PrefixCache` set on the runner
(`VLM.use_caches`; `trimvlm serve` sets one), that prefix is looked up first, keyed by what the prefill reads:
the processor's tensors of the prefix (token ids, and each image by its pixel content, never by its
placeholder) and the plan's label (a cached prefix is valid only for the same recipe). Only prefixes not found
are prefilled, one batch for the distinct ones (two requests of one batch with the same prefix prefill it
once). Each row is stored with its padding removed; a batch of prefixes is assembled by left padding them again
(padding is masked: the tails read the same keys and values), one row per distinct prefix: requests of one batch
with the same prefix read the same row (`PrefixReuse.rows`), so its KV is assembled once and attended by one call
per layer for all of their tails. Bounded in bytes, least recently used evicted
first (`lru.ByteLRU`). Off unless turned on: evaluations never read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from trimvlm.runtime.cache import FILL, KVCache, LayerKV, PrefillOutput, column_dim, padded_cat, state_rows
from trimvlm.runtime.lru import ByteLRU, digest, nbytes
from trimvlm.runtime.sequence import LiveSeq


@dataclass
class PrefixEntry:
    """One prefilled prefix, one row, its padding removed."""

    layers: dict[int, LayerKV]
    states: dict[int, dict[str, torch.Tensor]]
    next_pos: torch.Tensor  # [1]
    hidden: torch.Tensor  # [1, 1, D] its last final-normed state (branch executors read its width and dtype)
    n_images: int
    tokens: int
    # per field of LayerKV, its layers stacked ([layers, 1, ...]; `layers` are views of it), when every layer
    # holds the same columns: a batch of such entries is assembled with one copy per field and row
    stacked: dict[str, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        kv = [getattr(e, n) for e in self.layers.values() for n in FILL]
        return nbytes(kv) + nbytes(self.states) + self.next_pos.nbytes + self.hidden.nbytes


@dataclass
class PrefixReuse:
    """What a batch took from the cache: per request whether its prefix was reused (found, or prefilled for an
    earlier request of the same batch), its prefix tokens and images; the FLOPs of the prefill that ran."""

    hits: list[bool]
    tokens: list[int]
    n_images: list[int]
    prefill_flops: int
    computed: list[int] = field(default_factory=list)  # the requests whose prefix was prefilled
    rows: list[int] = field(default_factory=list)  # per request its row of the batch (a row per prefix)


class Stored(NamedTuple):
    """A prefilled row as the cache holds it: its entry, and the logits of its last token (None for a prefill
    that stopped at the final norm: a System One prefix)."""

    entry: PrefixEntry
    logits: torch.Tensor | None


@dataclass
class Filled:
    """What `PrefixCache.fill` returns: per slot its stored row; the slots prefilled (not found); their prefill
    as one batch (None: every slot was found)."""

    rows: list[Stored]
    prefilled: list[int]
    out: PrefillOutput | None


class PrefixCache(ByteLRU):
    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, "prefix cache")

    @staticmethod
    def key(label: str, inputs: dict) -> bytes:
        """The processor's tensors of a prefix and the recipe it runs with."""
        return digest("prefix", label, *(x for k in sorted(inputs) for x in (k, inputs[k])))

    def fill(self, runner, keys: list[bytes], prepare: Callable[[list[int]], object], plan, meter, *,
             lm_head: bool, tokens: Callable[[int], int]) -> Filled:  # fmt: skip
        """The one lookup / prefill / store: per slot (`keys[s]`) its row from the cache, else prefilled: the
        slots not found as one batch (`prepare(slots)` prepares it), each row stored under its key with its
        padding removed (`tokens(s)`: the slot's prompt tokens)."""
        rows = [self.get(k) for k in keys]
        todo = [s for s, r in enumerate(rows) if r is None]
        out = None
        if todo:
            prepared = prepare(todo)
            out = runner.prefill(prepared, plan, meter=meter, lm_head=lm_head)
            for b, s in enumerate(todo):
                rows[s] = store(self, keys[s], out, b, prepared.n_images[b], tokens(s))
        return Filled(rows=rows, prefilled=todo, out=out)

    def prefill(self, runner, inputs: list[dict], plan, meter, keys: list[bytes] | None = None
                ) -> tuple[PrefillOutput, PrefixReuse]:  # fmt: skip
        """The distinct prefixes of `inputs` (processor outputs, one per request) as one left-padded
        `PrefillOutput`, a row per distinct prefix (`PrefixReuse.rows`: each request's): found ones from the
        cache, the others prefilled (`runner.prefill` on the adapter's batch of them). `keys`: their `key`s,
        when the caller has them."""
        keys = [self.key(plan.label(), x) for x in inputs] if keys is None else keys
        distinct = list(dict.fromkeys(keys))  # in order of first use
        first = [keys.index(k) for k in distinct]
        before = meter.costs.flops.get("prefill", 0)
        filled = self.fill(
            runner, distinct, lambda slots: runner.adapter.prepare_processed([inputs[first[s]] for s in slots]),
            plan, meter, lm_head=False, tokens=lambda s: int(inputs[first[s]]["input_ids"].shape[-1]),
        )  # fmt: skip
        computed = [first[s] for s in filled.prefilled]
        slot = {k: s for s, k in enumerate(distinct)}
        rows = [filled.rows[slot[k]].entry for k in keys]
        reuse = PrefixReuse(
            hits=[i not in computed for i in range(len(keys))], tokens=[e.tokens for e in rows],
            n_images=[e.n_images for e in rows], prefill_flops=meter.costs.flops.get("prefill", 0) - before,
            computed=computed, rows=[slot[k] for k in keys],
        )  # fmt: skip
        return assemble([r.entry for r in filled.rows], runner.num_layers), reuse


def stack_layers(layers: dict[int, LayerKV]) -> tuple[dict[int, LayerKV], dict[str, torch.Tensor] | None]:
    """(the layers as views of one tensor per field, those tensors), when every layer has the same shapes
    (a reducer that drops tokens at some layer leaves layers of different lengths: kept as they are, None)."""
    parts = list(layers.values())
    if not parts or any(
        getattr(e, n).shape != getattr(parts[0], n).shape for e in parts for n in FILL
    ):  # fmt: skip
        return layers, None
    stacked = {n: torch.stack([getattr(e, n) for e in parts]) for n in FILL}
    views = {i: LayerKV(**{n: stacked[n][j] for n in FILL}) for j, i in enumerate(layers)}
    return views, stacked


def assemble(rows: list[PrefixEntry], num_layers: int) -> PrefillOutput:
    """Entries as one left-padded batch (a prefill's output with no logits: what the branch executors read).
    Stacked entries (`PrefixEntry.stacked`, the same layers) are copied once per field for all layers."""
    cache = KVCache(num_layers)
    if all(r.stacked is not None and r.layers.keys() == rows[0].layers.keys() for r in rows):
        parts = {n: [r.stacked[n] for r in rows] for n in FILL}  # [L, 1, ...] each
        out = {n: padded_cat(p, FILL[n], column_dim(p[0][0]) + 1, batch=1) for n, p in parts.items()}
        cache.layers = {i: LayerKV(**{n: out[n][j] for n in FILL}) for j, i in enumerate(rows[0].layers)}
    else:
        for i in rows[0].layers:
            parts = {n: [getattr(r.layers[i], n) for r in rows] for n in FILL}
            padded = {n: padded_cat(p, FILL[n], column_dim(p[0])) for n, p in parts.items()}
            cache.layers[i] = LayerKV(**padded)
    cache.states = {
        i: {k: torch.cat([r.states[i][k] for r in rows]) for k in st} for i, st in rows[0].states.items()
    }
    hidden = torch.cat([r.hidden for r in rows])
    b, dev = hidden.shape[0], hidden.device
    positions = torch.zeros(1, b, 1, dtype=torch.long, device=dev)
    seq = LiveSeq.text(hidden, positions, torch.ones(b, 1, dtype=torch.bool, device=dev))
    return PrefillOutput(logits=None, seq=seq, cache=cache, next_pos=torch.cat([r.next_pos for r in rows]))


def prompt_key(label: str, prepared) -> bytes:
    """A request's prompt (a batch of one, unpadded) by what its prefill reads, and the recipe it runs."""
    inputs = prepared.model_inputs
    return digest("chat", label, prepared.input_ids, *(x for k in sorted(inputs) for x in (k, inputs[k])))


def prefill_prompts(runner, parts: list, plan, meter, keys: list | None = None) -> tuple[PrefillOutput, list[bool]]:
    """The prefill of the requests `parts` (each prepared alone) as one batch, and per request whether it was
    found: with the runner's prefix cache on and a plan whose prompts are reusable, the prompts found there are
    read from it, the others prefilled together and stored. `keys`: their `prompt_key`s, when already made."""
    cache = runner.prefix_cache
    if cache is None or not plan.reuses_prompts:
        return runner.prefill(runner.adapter.collate(parts), plan, meter=meter), [False] * len(parts)
    keys = [
        k if k is not None else prompt_key(plan.label(), p)
        for k, p in zip(keys or [None] * len(parts), parts, strict=True)
    ]
    filled = cache.fill(
        runner, keys, lambda slots: runner.adapter.collate([parts[i] for i in slots]), plan, meter, lm_head=True,
        tokens=lambda i: int(parts[i].attention_mask.sum()),
    )  # fmt: skip
    hits = [i not in filled.prefilled for i in range(len(parts))]
    if len(filled.prefilled) == len(parts):
        return filled.out, hits  # all prefilled now: their batch as it is
    rows = assemble([r.entry for r in filled.rows], runner.num_layers)
    logits = torch.cat([r.logits for r in filled.rows])
    return PrefillOutput(logits=logits, seq=rows.seq, cache=rows.cache, next_pos=rows.next_pos), hits


def store(cache: PrefixCache, key: bytes, out: PrefillOutput, b: int, n_images: int, tokens: int) -> Stored:
    """Row b of a prefill stored under `key`: its entry (per layer its valid columns, copies; its recurrent
    states) and, when the prefill ran the LM head, the logits of its last token."""
    layers = {}
    for i, e in out.cache.layers.items():
        cols = torch.nonzero(e.valid[b]).flatten()
        layers[i] = e.map(lambda _, t, cols=cols: t[b : b + 1].index_select(column_dim(t), cols))
    layers, stacked = stack_layers(layers)
    entry = PrefixEntry(
        layers=layers, states=state_rows(out.cache.states, out.next_pos.new_tensor([b])),
        next_pos=out.next_pos[b : b + 1].clone(), hidden=out.seq.hidden[b : b + 1, -1:].clone(),
        n_images=n_images, tokens=tokens, stacked=stacked,
    )  # fmt: skip
    item = Stored(entry, None if out.logits is None else out.logits[b : b + 1].clone())
    cache.put(key, item, entry.nbytes + nbytes(item.logits))
    return item
