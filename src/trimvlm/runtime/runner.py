"""The layer loop: trimvlm drives the unmodified transformers decoder layers itself.

The one execution path. `prefill(prepared, plan)` embeds the batch and applies everything the `Plan` holds:
it calls the plan's token hook before each layer (L = 0 is before the first layer) so a reducer can gather the
live sequence to a subset, runs every decoder layer the plan does not skip (a skipped layer is not executed; a
per-sample plan runs a layer on the rows that keep it), records what the plan's methods asked for, writes a
`KVCache` and runs the plan's KV step at the prefill/decode boundary. `step` runs a chunk of new tokens (decode)
against that cache with the plan's decode layers; `branch` runs candidate rows off a prefix cache, uncopied.
Generation, scoring, decisions, serving, the lmms bridge and router training are compositions of these.

A prefill is one body, `Prefill`: `prefill` runs it over the whole prompt at once, `prefill_chunked` hands it
to a caller (the server's scheduler) that runs it a few positions at a time and interleaves other work between
two chunks. Causal attention makes the chunked result the same function of the prompt (to float rounding, as any
change of batching is). Only a plan that reads nothing of the whole prefill at once can be chunked
(`Plan.chunkable`): a token reducer needs the whole sequence at its layer, a KV policy and the attention probes
read the whole prefill. A plan that acts when the batch is prepared (tokens=downsample) is chunkable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from trimvlm.errors import RecipeError, TrimVLMError
from trimvlm.kernels.flops import count, counting, paused
from trimvlm.runtime.attention import AttentionContext, select_attention
from trimvlm.runtime.cache import KVCache, PrefillOutput
from trimvlm.runtime.layers import ATTENTION
from trimvlm.runtime.meter import FlopsMemo, Meter
from trimvlm.runtime.plan import LayerPlan, Plan
from trimvlm.runtime.prefix_cache import assemble, prefill_prompts
from trimvlm.runtime.routes import prefill_routes
from trimvlm.runtime.sequence import LiveSeq, next_positions

# hook(layer_idx, seq, runner) -> seq ; called before layer `layer_idx` runs (and with num_layers at the end)
TokenHook = Callable[[int, LiveSeq, "Runner"], LiveSeq]


class Runner:
    def __init__(self, adapter):
        self.adapter = adapter
        self.flops = FlopsMemo()  # the vision tower's FLOPs per input shape (and the vision cache's encodes)
        self.prefix_cache = None  # a PrefixCache (runtime/prefix_cache.py), set by `VLM.use_caches`
        select_attention(adapter.text_model)

    def encode(self, prepared, meter: Meter, vision=None) -> LiveSeq:
        """Embed the batch (the vision tower runs once, timed on the meter's vision line) and book the vision
        tower's FLOPs, counted on this very encode the first time its input shapes (`Adapter.vision_key`) are
        seen and remembered (benchmarks warm every shape up first: the counter slows that call). With a
        vision-tower probe (method work inside the encode) an unseen shape is counted on an untimed encode."""
        cache = self.adapter.vision_cache if vision is None and self.adapter.caches_vision else None
        if cache is not None:
            cache.last_flops = 0
        with meter.timer("vision"), counting(meter, "vision"):
            if cache is not None or vision is not None:
                seq = self.adapter.embed(prepared, vision)
            else:
                seq, _ = self.flops.run(self.adapter.vision_key(prepared), lambda: self.adapter.embed(prepared))
        # the vision cache books the images it did not hold (runtime/vision_cache.py)
        meter.add("vision", cache.last_flops if cache is not None else self.vision_flops(prepared))
        return seq

    def vision_flops(self, prepared) -> int:
        """The vision tower's FLOPs for this batch: remembered per input shape, else counted on an untimed encode
        (only for a shape no prefill has seen; `encode` counts on the real run)."""
        key = self.adapter.vision_key(prepared)
        flops = self.flops.get(key)
        if flops is None:
            cache = self.adapter.vision_cache  # the tower is counted, not a lookup
            self.adapter.vision_cache = None
            try:
                with paused():
                    _, flops = self.flops.run(key, lambda: self.adapter.embed(prepared))
            finally:
                self.adapter.vision_cache = cache
        return flops

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def device(self) -> torch.device:
        return self.adapter.model.device

    def layer_keys(self, i: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """`Adapter.layer_keys`."""
        return self.adapter.layer_keys(i, hidden)

    def is_attention(self, i: int) -> bool:
        return self.adapter.layer_types[i] == ATTENTION

    def check_skip(self, skip, batch: int) -> None:
        """`skip`: a set of layers skipped by every sample, or a per-sample plan, a [B, num_layers] bool tensor
        (True: that sample skips that layer)."""
        if isinstance(skip, LayerPlan):
            return
        if isinstance(skip, torch.Tensor):
            if skip.dtype != torch.bool or tuple(skip.shape) != (batch, self.num_layers):
                raise RecipeError(
                    f"a per-sample layer plan must be a bool tensor [batch={batch}, layers={self.num_layers}], "
                    f"got {skip.dtype} {tuple(skip.shape)}"
                )
            if bool(skip.all(1).any()):
                raise RecipeError("a per-sample layer plan skips every layer of some sample; one must run")
            return
        self.check_layers(skip, "skipped layer")

    def check_layers(self, layers, what: str = "layer") -> None:
        for i in layers:
            if not 0 <= int(i) < self.num_layers:
                raise RecipeError(
                    f"{what} index {i} out of range: this model has layers 0..{self.num_layers - 1}"
                )

    @torch.no_grad()
    def prefill(
        self,
        prepared,
        plan: Plan | None = None,
        *,
        meter: Meter | None = None,
        all_logits: bool = False,
        lm_head: bool = True,
    ) -> PrefillOutput:
        """Embed, run the layers with everything `plan` holds (None: nothing), final norm, LM head, then the
        plan's KV step at the prefill/decode boundary (timed and counted on the prefill line). `lm_head=False`
        stops at the final-normed states (logits None: a caller that reads states, e.g. a decision readout)."""
        work = Prefill(self, prepared, plan or Plan(), meter or Meter(device=self.device), all_logits, lm_head)
        return work.advance(work.left)

    def prefill_chunked(self, prepared, plan: Plan | None = None, *, meter: Meter | None = None, prefix=None):
        """The `Prefill` of one prepared request (a batch of one), for its caller to `advance`. `prefix`: a
        `PrefixEntry` of the prompt's first tokens (an earlier turn of the same conversation), not run again."""
        plan = plan or Plan()
        if prepared.batch != 1:
            raise TrimVLMError(f"a chunked prefill holds one request, got a batch of {prepared.batch}")
        if not plan.chunkable:
            raise TrimVLMError(f"{plan.label()} reads the whole prefill at once: it cannot be prefilled in chunks")
        return Prefill(self, prepared, plan, meter or Meter(device=self.device), prefix=prefix)

    def prefill_prompts(self, parts: list, plan: Plan, *, meter: Meter, keys: list | None = None):
        """runtime/prefix_cache.py, `prefill_prompts`."""
        return prefill_prompts(self, parts, plan, meter, keys)

    def run(
        self,
        seq: LiveSeq,
        cache: KVCache,
        *,
        phase: str,
        hook: TokenHook | None = None,
        skip=frozenset(),
        meter: Meter | None = None,
        ctx: AttentionContext | None = None,
        start: int = 0,
    ) -> LiveSeq:
        """Run the decoder layers `start`.. over the chunk `seq`, appending to `cache`; the final-normed seq."""
        ad = self.adapter
        select_attention(ad.text_model)  # (nothing is written unless someone changed it since)
        pos_emb = ad.rotary(seq.hidden, seq.positions)
        masks: dict[int, torch.Tensor] = {}
        cache.begin_chunk(seq.valid, seq.visual, seq.source)
        ctx = _reading(ctx, cache)
        hidden = seq.hidden
        read: dict[int, int] = {}  # per shared part, the rows that read it (owner >= 0), counted once per run
        ran = torch.full((seq.batch,), start, dtype=torch.long, device="cpu")  # per row: layers run so far
        with counting(meter, phase):
            for i in range(start, self.num_layers):
                if hook is not None:
                    cur = seq.with_hidden(hidden)
                    new = hook(i, cur, self)
                    if new is not None and new is not cur:
                        seq, hidden = new, new.hidden
                        pos_emb = ad.rotary(hidden, seq.positions)
                        masks.clear()
                        cache.begin_chunk(seq.valid, seq.visual, seq.source)
                rows = _layer_rows(skip, i, ctx)  # None: every row; SKIPPED: no row
                if rows is SKIPPED:
                    continue
                past = cache.past_valid(i)
                key = id(past)
                if key not in masks:
                    # a fresh, unpadded, causal chunk needs no mask: SDPA's causal kernel, as transformers does
                    plain = past is None and cache.prefix is None and bool(seq.valid.all())
                    masks[key] = None if plain else chunk_mask(past, seq.valid)
                k_len, partial = self._keys(i, seq, rows, past, ctx, cache, read)
                if ctx is not None and ctx.probe is not None:
                    ctx.probe.chunk_valid = seq.valid
                if rows is None:
                    hidden = ad.run_layer(i, hidden, pos_emb, masks[key], cache, ctx, seq.valid)
                else:
                    hidden = self._run_rows(i, rows, hidden, pos_emb, masks[key], cache, ctx, seq.valid)
                hidden, ran = self._after_layer(ran, rows, seq, hidden)
                if meter is not None:
                    self._book(meter, phase, i, seq, rows, k_len, partial, cache)
        if hook is not None:
            new = hook(self.num_layers, seq.with_hidden(hidden), self)
            if new is not None:
                seq, hidden = new, new.hidden
        return seq.with_hidden(ad.final_norm(hidden))

    def _book(self, meter, phase, i, seq, rows, k_len, partial, cache) -> None:
        """Layer i's FLOPs on the rows that ran it (a tree's recurrent layers: the chains it ran)."""
        n, q = (seq.batch if rows is None else len(rows)), seq.length
        if cache.tree is not None and self.adapter.layer_types[i] != ATTENTION:
            n, q = 1, cache.tree.tokens_run
        meter.add_layer(phase, i, self.adapter.layer_flops(i, n, q, k_len) + partial)

    def _keys(self, i, seq, rows, past, ctx, cache, read) -> tuple[int, int]:
        """(the keys every running row of layer i attends to, the attention FLOPs over shared parts that only
        some of them read: booked for their readers only)."""
        ad = self.adapter
        k_len, partial = seq.length + (0 if past is None else past.shape[1]), 0
        if ctx is not None and ctx.shares(i):
            n = seq.batch if rows is None else len(rows)
            for p in ctx.layer_parts(i):
                k_p, readers = p.layers[i].valid.shape[1], _readers(p, rows, read)
                if readers == n:
                    k_len += k_p
                else:
                    partial += ad.layer_flops(i, readers, seq.length, k_p) - ad.layer_flops(i, readers, seq.length, 0)
            k_len += 0 if cache.tree is None else cache.tree.ancestors.shape[1]
        return k_len, partial

    @torch.no_grad()
    def finish(self, seq: LiveSeq, start: int) -> torch.Tensor:
        """[B, V] next-token logits of `seq` entering layer `start`, run through the remaining layers on a
        scratch cache; its FLOPs are counted on the active method line (a method that looks ahead pays)."""
        meter = Meter(device=self.device)
        with paused():
            out = self.run(seq, KVCache(self.num_layers), phase="lookahead", meter=meter, start=start)
            logits = self.logits(out, meter, "lookahead", False)
        count(meter.costs.model_flops)
        return logits

    def _after_layer(self, ran, rows, seq, hidden):
        """`Adapter.after_layer` after a layer that ran on all rows (`rows` None) or on `rows`; (hidden, the
        rows' counts of layers run)."""
        if rows is None and not seq.adds:  # nothing the family adds (a decode step, a text-only chunk)
            return hidden, ran + 1
        runs = torch.ones_like(ran, dtype=torch.bool)
        if rows is not None:
            runs = torch.zeros_like(runs).index_fill_(0, rows.cpu(), True)
        index = torch.where(runs, ran, -1)
        return self.adapter.after_layer(index, seq, hidden), ran + runs

    def _run_rows(self, i, rows, hidden, pos_emb, mask, cache, ctx, valid) -> torch.Tensor:
        """Run layer i on batch rows `rows` only (gather, run, scatter); the other rows pass through."""
        sub = cache.layer_rows(i, rows)
        if ctx is not None and ctx.shared:  # the rows read their own owners' rows of the shared prefix
            ctx = replace(ctx, shared=sub.prefix.parts)
        pe = tuple(t.index_select(0, rows) for t in pos_emb)
        m = None if mask is None else mask.index_select(0, rows)
        out_rows = self.adapter.run_layer(i, hidden.index_select(0, rows), pe, m, sub, ctx, valid.index_select(0, rows))
        cache.put_layer_rows(i, rows, sub)
        return hidden.index_copy(0, rows, out_rows.to(hidden.dtype))

    def logits(self, seq: LiveSeq, meter: Meter | None, phase: str, all_logits: bool) -> torch.Tensor:
        h = seq.hidden if all_logits else seq.hidden[:, -1]
        if meter is not None:
            meter.add(phase, self.adapter.head_flops(seq.batch, seq.length if all_logits else 1))
        return self.adapter.lm_head(h).float()

    @torch.no_grad()
    def step(self, tokens, positions, cache, plan: Plan | None = None, *, all_logits: bool = False, **kw):
        """Run new text tokens [B, Q] at `positions` [A, B, Q] against the cache with the plan's decode layers
        (its candidate-branch layers for phase "branch"); return logits (the options of `step_hidden`)."""
        seq = self.step_hidden(tokens, positions, cache, plan=plan, **kw)
        return self.logits(seq, kw.get("meter"), kw.get("phase", "decode"), all_logits)

    @torch.no_grad()
    def step_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        *,
        valid: torch.Tensor | None = None,
        skip=None,
        meter: Meter | None = None,
        phase: str = "decode",
        plan: Plan | None = None,
    ) -> LiveSeq:
        """Run new text tokens [B, Q] at `positions` [A, B, Q] against the cache (`valid` marks real tokens,
        `skip` the plan's layers for the phase); the final-normed live sequence."""
        if skip is None:  # the plan's layers for the phase ("branch": candidate rows)
            skip = frozenset() if plan is None else plan.skip_branch if phase == "branch" else plan.skip_decode
        valid = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device) if valid is None else valid
        seq = LiveSeq.text(self.adapter.embed_tokens(tokens), positions, valid)
        return self.run(seq, cache, phase=phase, skip=skip, meter=meter)


SKIPPED = object()  # `_layer_rows`: no row runs the layer


def chunk_mask(past_valid: torch.Tensor | None, new_valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, Q, Kp + Q] bool (True: may attend): every query sees the valid past entries and, inside the
    chunk, the valid keys up to itself (causal). A query always sees itself, so padded rows stay finite (their
    outputs are never read)."""
    b, q = new_valid.shape
    causal = torch.ones(q, q, dtype=torch.bool, device=new_valid.device).tril()
    own = (causal & new_valid[:, None, :]) | torch.eye(q, dtype=torch.bool, device=new_valid.device)
    if past_valid is None or past_valid.shape[1] == 0:
        return own[:, None]
    past = past_valid[:, None, :].expand(b, q, past_valid.shape[1])
    return torch.cat([past, own], dim=-1)[:, None]


def _reading(ctx: AttentionContext | None, cache: KVCache) -> AttentionContext | None:
    """`ctx` (or a new one) with the cache's shared prefix parts and candidate tree, when it has them."""
    if (cache.prefix is not None and cache.prefix.parts) or cache.tree is not None:
        ctx = ctx or AttentionContext()
        ctx.shared = cache.prefix.parts if cache.prefix is not None else None
        ctx.tree = cache.tree
    return ctx


def _layer_rows(skip, i: int, ctx: AttentionContext | None):
    """The rows that run layer i under `skip` (a set of layers, a [B, L] bool per-sample plan or a `LayerPlan`,
    read now: the router's hook sets it during the prefill): None for every row, SKIPPED for none."""
    now = skip.plan if isinstance(skip, LayerPlan) else skip
    if now is None:
        return None
    if not isinstance(now, torch.Tensor):
        return SKIPPED if i in now else None
    runs = ~now[:, i]
    if not bool(runs.any()):
        return SKIPPED
    if bool(runs.all()):
        return None
    if ctx is not None and (ctx.tree is not None or (ctx.probe is not None and ctx.probe.wants(i))):
        raise TrimVLMError(
            "per-sample layer plans do not combine with candidate trees or attention probes (in the layers they "
            "record) yet"
        )
    return torch.nonzero(runs).flatten()


def _readers(part, rows: torch.Tensor | None, memo: dict[int, int]) -> int:
    """How many of the running rows (`rows`: a per-sample plan's subset, else all) read a shared part."""
    if rows is not None:
        return int((part.owner.index_select(0, rows.to(part.owner.device)) >= 0).sum())
    if id(part) not in memo:
        memo[id(part)] = int((part.owner >= 0).sum())
    return memo[id(part)]


class Prefill:
    """A prefill in progress: made, it embeds the batch (the vision tower runs once); each `advance(n)` runs the
    next `n` positions through the decoder with everything the plan holds, against the KV cache the earlier
    chunks wrote. The last chunk gives the `PrefillOutput` and runs the plan's step at the prefill/decode
    boundary (`after_prefill`); `meter` books all of it. `prefix`: a `PrefixEntry` the cache starts as."""

    def __init__(self, runner: Runner, prepared, plan: Plan, meter: Meter, all_logits=False, lm_head=True, *,
                 prefix=None):  # fmt: skip
        if getattr(prepared, "resolution", None) != plan.resolution:  # the batch fits the plan
            raise TrimVLMError(
                f"{plan.label()}: the batch was prepared at another resolution than the plan's (tokens=downsample "
                "resizes the images when they are prepared): prepare it with vlm.prepare(images, prompts, "
                "plan=plan) (vlm.generate and vlm.score do)"
            )
        runner.check_skip(plan.skip_prefill, prepared.batch)
        self.runner, self.plan, self.meter = runner, plan, meter
        self.all_logits, self.lm_head = all_logits, lm_head
        self.ctx = plan.attention_context()
        self.seq = runner.encode(prepared, meter, None if self.ctx is None else self.ctx.vision)
        self.next_pos = next_positions(self.seq.positions, self.seq.valid)
        self.cache = KVCache(runner.num_layers)
        self.done = self.reused = 0  # positions already run; those read from `prefix`
        if prefix is not None:
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
        if self.plan.routes is not None:  # each group of rows under its own plan (never chunked: per_sample)
            return prefill_routes(self)
        n = max(1, min(tokens, self.left))
        part = self.seq
        if n < self.seq.length:
            cols = torch.arange(self.done, self.done + n, device=self.seq.valid.device)[None]
            part = self.seq.index_select(cols, self.seq.valid[:, self.done : self.done + n])
        runner, meter, plan = self.runner, self.meter, self.plan
        with meter.timer("prefill"):
            out = runner.run(part, self.cache, phase="prefill", hook=plan.hook, skip=plan.skip_prefill, meter=meter,
                             ctx=self.ctx)  # fmt: skip
            self.done += n
        if self.left:
            return None
        return self.finish(out, self.cache, self.next_pos, plan)

    def finish(self, out: LiveSeq, cache: KVCache, next_pos: torch.Tensor, plan: Plan) -> PrefillOutput:
        """The output of rows whose last layer gave `out` on `cache`: their logits, the KV at the prefill/decode
        boundary, then `plan`'s KV step there (a routed prefill finishes each group of rows with its own plan)."""
        meter = self.meter
        with meter.timer("prefill"):
            logits = self.runner.logits(out, meter, "prefill", self.all_logits) if self.lm_head else None
        meter.kv(cache)
        result = PrefillOutput(logits=logits, seq=out, cache=cache, next_pos=next_pos)
        if plan.after_prefill is not None:
            with meter.timer("prefill"), counting(meter, "prefill"):
                plan.after_prefill(result)
            meter.kv(result.cache)
        return result


@torch.no_grad()
def branch(
    runner: Runner, prefix: PrefillOutput, owner: torch.Tensor, tokens: torch.Tensor, *,
    meter: Meter | None = None, plan: Plan | None = None,
) -> torch.Tensor:  # fmt: skip
    """Run N continuations `tokens` [N, Q] as one batch, branch n reading prefix row owner[n] of the shared,
    uncopied prefix cache (the plan's candidate-branch layers). Returns logits [N, Q, V]. The prefix cache is
    left unchanged."""
    cache = prefix.cache.share_prefix(owner)
    positions = runner.adapter.text_positions(prefix.next_pos.index_select(0, owner), tokens.shape[1])
    return runner.step(tokens, positions, cache, plan, meter=meter, phase="branch", all_logits=True)
