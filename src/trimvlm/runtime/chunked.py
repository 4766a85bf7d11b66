"""Chunked prefill (`Runner.prefill_chunked`): one request's prompt run through the decoder a few positions at a
time, so a caller (the server's scheduler) can interleave other work between two chunks.

`ChunkedPrefill` embeds the prompt once (the vision tower runs once, when it is made), then each `advance(n)`
runs its next `n` positions through every decoder layer the plan does not skip, against the KV cache the earlier
chunks wrote (`Runner.run` over a column slice of the embedded sequence: each chunk attends to all the cache
holds and causally within itself). The last chunk gives the `PrefillOutput` a whole `Runner.prefill` gives: the
logits at the prompt's last token, the cache, the next position. Causal attention makes the result the same
function of the prompt (to float rounding, as any change of batching is).

With `prefix` (a `PrefixEntry` of the prompt's first tokens, runtime/prefix_cache.py: an earlier turn of the
same conversation) the cache starts as that entry's and only the rest of the prompt is run.

Only a plan that changes nothing inside the prefill can be chunked (`Plan.chunkable`): a token reducer needs the
whole sequence at its layer, a KV policy and the attention probes read the whole prefill. A plan that acts when
the batch is prepared (tokens=downsample) is chunkable: the batch must have been prepared with it (checked).
"""

from __future__ import annotations

import torch

from trimvlm.errors import TrimVLMError
from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.plan import Plan
from trimvlm.runtime.runner import PrefillOutput, next_positions


class ChunkedPrefill:
    """One prepared request (a batch of one) prefilled `advance(n)` positions at a time; `meter` books all of it."""

    def __init__(self, runner, prepared, plan: Plan, meter: Meter, prefix=None):
        if prepared.batch != 1:
            raise TrimVLMError(f"a chunked prefill holds one request, got a batch of {prepared.batch}")
        if not plan.chunkable:
            raise TrimVLMError(f"{plan.label()} reads the whole prefill at once: it cannot be prefilled in chunks")
        runner.check_prepared(prepared, plan)
        self.runner, self.plan, self.meter = runner, plan, meter
        self.seq = runner.encode(prepared, meter)
        self.next_pos = next_positions(self.seq)
        self.cache = KVCache(runner.num_layers)
        self.done = 0  # positions already run
        self.reused = 0  # positions read from `prefix`
        if prefix is not None:
            from trimvlm.runtime.prefix_cache import assemble

            if not 0 < prefix.tokens < self.seq.length:
                raise TrimVLMError(f"a prefix of {prefix.tokens} tokens for a prompt of {self.seq.length}")
            self.cache = assemble([prefix], runner.num_layers).cache
            self.done = self.reused = prefix.tokens

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
            logits = runner.logits(out, meter, "prefill", False)
        meter.kv(self.cache)
        return PrefillOutput(logits=logits, seq=out, cache=self.cache, next_pos=self.next_pos)
