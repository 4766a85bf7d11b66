"""Generation loop over the runner: greedy or seeded temperature / top-p sampling, stop tokens, max tokens.

Decoding continues from the cache whatever its length: each new token's position is the sample's next
original position (`next_pos`), never the (possibly shrunk) cache length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trimvlm.errors import InputError
from trimvlm.runtime.attention import AttentionContext
from trimvlm.runtime.meter import Costs, Meter
from trimvlm.runtime.runner import PrefillOutput, Runner


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [B, T] generated ids, pad after a sample stopped
    lengths: torch.Tensor  # [B] generated tokens per sample, stop token included
    first_logits: torch.Tensor  # [B, V] logits of the first generated token (the prefill probe)
    costs: Costs


def choose(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > sampling.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(
    runner: Runner,
    prepared,
    *,
    max_new_tokens: int,
    stop_ids: list[int] | None = None,
    pad_id: int = 0,
    sampling: Sampling | None = None,
    hook=None,
    skip_prefill=frozenset(),
    skip_decode=frozenset(),
    after_prefill: Callable[[PrefillOutput], None] | None = None,
    meter: Meter | None = None,
    probe=None,
) -> GenerationOutput:
    """`probe` (an AttentionProbe) records prefill attention rows for methods that score by attention."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = sampling or Sampling()
    meter = meter or Meter()
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    meter.start_memory()
    ctx = AttentionContext(probe=probe) if probe is not None else None
    out = runner.prefill(prepared, hook=hook, skip=skip_prefill, meter=meter, ctx=ctx)
    if after_prefill is not None:
        with meter.timer("prefill"):
            after_prefill(out)
        meter.kv(out.cache)
    b = prepared.batch
    stops = torch.tensor(stop_ids or [], dtype=torch.long)
    finished = torch.zeros(b, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    tokens = []
    logits, pos = out.logits, out.next_pos.clone()
    with meter.timer("decode"):
        for t in range(max_new_tokens):
            tok = choose(logits, sampling, gen).masked_fill(finished, pad_id)
            tokens.append(tok)
            lengths += (~finished).long()
            finished |= torch.isin(tok, stops)
            if bool(finished.all()) or t == max_new_tokens - 1:
                break
            positions = runner.adapter.text_positions(pos, 1)
            logits = runner.step(tok[:, None], positions, out.cache, skip=skip_decode, meter=meter)
            pos += 1
    meter.kv_end(out.cache)
    meter.stop_memory()
    return GenerationOutput(torch.stack(tokens, 1), lengths, out.logits, meter.costs)
