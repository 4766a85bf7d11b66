"""Chunked prefill: one request's prompt run through the decoder a few tokens at a time, across scheduler turns.

A prompt longer than the scheduler's `--max-prefill-tokens` would stall every running stream for the whole of
its prefill. `ChunkedPrefill` embeds it once (the vision tower runs once, at the first chunk), then each
`advance(n)` runs its next `n` positions through every decoder layer against the KV cache the earlier chunks
wrote (`Runner.run` over a column slice of the embedded sequence: each chunk attends to all the cache holds and
causally within itself), so the scheduler can interleave a decode step of the running rows between two chunks.
The last chunk yields the `PrefillOutput` a whole `Runner.prefill` gives: the logits at the prompt's last
token, the cache, the next position. Causal attention makes the result the same function of the prompt (to
float rounding, as any change of batching is); the tests compare the answers with the request run alone.

Only a plan that changes nothing inside the prefill can be chunked (`chunkable`): a token reducer needs the
whole sequence at its layer, a KV policy and the attention probes read the whole prefill. Such a request is
prefilled whole, as before (bounded, not chunked).
"""

from __future__ import annotations

import torch

from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.plan import Plan
from trimvlm.runtime.runner import PrefillOutput, _next_positions


def chunkable(plan: Plan) -> bool:
    """Whether a prefill under `plan` may run in chunks (nothing in it reads the whole prompt at once)."""
    return (
        plan.hook is None
        and plan.after_prefill is None
        and plan.attention_context() is None
        and not plan.per_sample
    )


class ChunkedPrefill:
    """One prepared request (a batch of one) prefilled `advance(n)` tokens at a time; `meter` books all of it."""

    def __init__(self, runner, prepared, plan: Plan, meter: Meter):
        if prepared.batch != 1:
            raise ValueError(f"a chunked prefill holds one request, got a batch of {prepared.batch}")
        self.runner, self.plan, self.meter = runner, plan, meter
        runner.check_skip(plan.skip_prefill, 1)
        self.seq = runner.encode(prepared, meter)
        self.next_pos = _next_positions(self.seq)
        self.cache = KVCache(runner.num_layers)
        self.done = 0  # positions already run

    @property
    def left(self) -> int:
        return self.seq.length - self.done

    @torch.no_grad()
    def advance(self, tokens: int) -> PrefillOutput | None:
        """Run the next `tokens` positions (at least one); the prefill's output once the prompt is done."""
        n = max(1, min(tokens, self.left))
        cols = torch.arange(self.done, self.done + n, device=self.seq.valid.device)[None]
        part = self.seq.index_select(cols, self.seq.valid[:, self.done : self.done + n])
        runner, meter = self.runner, self.meter
        with meter.timer("prefill"):
            out = runner.run(part, self.cache, phase="prefill", skip=self.plan.skip_prefill, meter=meter)
            self.done += n
            if self.left:
                return None
            logits = runner._logits(out, meter, "prefill", False)
        meter.kv(self.cache)
        return PrefillOutput(logits=logits, seq=out, cache=self.cache, next_pos=self.next_pos)
