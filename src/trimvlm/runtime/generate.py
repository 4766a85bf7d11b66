"""Generation loop over the runner: greedy or seeded temperature / top-p sampling, stop tokens, max tokens.

Decoding continues from the cache whatever its length: each new token's position is the sample's next
original position (`next_pos`), never the (possibly shrunk) cache length. `Decoding` is the decode batch
itself, one step at a time: `generate` runs it to the end, a server's scheduler (continuous batching) lets
rows join it between steps and leave it at any step. `generate` is also the teacher-forced loop (`forced`:
the tokens fed, whatever the logits say) and shows each step's logits to a reader (`on_logits`), as router
training reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trimvlm.errors import InputError
from trimvlm.options import is_int, require_number
from trimvlm.runtime.meter import Costs, Meter
from trimvlm.runtime.plan import LayerPlan, Plan, fixed_skip, skip_rows
from trimvlm.runtime.runner import Runner


@dataclass
class Sampling:
    """How each next token is chosen: greedy (temperature 0) or drawn at `temperature` from the top-p nucleus
    with a generator seeded by `seed`; `presence_penalty` and `frequency_penalty` (-2..2) as OpenAI defines them:
    before the choice, each token's logit falls by `frequency_penalty` times the times it was generated so far,
    plus `presence_penalty` once it was generated at all (the prompt's tokens are not counted)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def __post_init__(self):
        try:  # the options' own checks (trimvlm.options), refused as the caller's input
            for name in ("presence_penalty", "frequency_penalty"):
                require_number(name, getattr(self, name), -2, 2)
            require_number("temperature", self.temperature, 0, hint=" (0 = greedy)")
            require_number("top_p", self.top_p, 0, 1, above=True)
        except ValueError as e:
            raise InputError(str(e)) from None
        if not is_int(self.seed) or not -(2**63) <= self.seed < 2**64:
            raise InputError(f"seed must be an integer (64-bit; not a bool or a float), got {self.seed!r}")


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [B, T] generated ids, pad after a sample stopped
    lengths: torch.Tensor  # [B] generated tokens per sample, stop token included
    first_logits: torch.Tensor  # [B, V] logits of the first generated token (the prefill probe)
    costs: Costs


def penalize(logits: torch.Tensor, sampling: Sampling, counts: torch.Tensor | None) -> torch.Tensor:
    """`logits` [B, V] less the sampling's penalties for `counts` [B, V] (each token's generations so far)."""
    if counts is None or not sampling.penalized:
        return logits
    return logits - counts * sampling.frequency_penalty - (counts > 0).to(logits.dtype) * sampling.presence_penalty


def choose(
    logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """The next token of each row of `logits` [B, V] (`counts`: the rows' generated-token counts, for the
    penalties)."""
    logits = penalize(logits, sampling, counts)
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


class Decoding:
    """Rows decoding together against one cache: their next positions and decode layer plan (`skip`: the
    plan's `skip_decode`, a set of layers, a per-sample [B, L] bool or a `LayerPlan`). `step(tokens)` runs
    each row's newest token and returns the next logits [B, V]; `keep(rows)` lets the others leave (their cache
    rows freed); `join(other)` appends another batch's rows (a request admitted between steps)."""

    def __init__(self, runner: Runner, cache, next_pos: torch.Tensor, skip=frozenset()):
        self.runner, self.cache, self.pos, self.skip = runner, cache, next_pos, skip

    def __len__(self) -> int:
        return int(self.pos.shape[0])

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, meter: Meter | None = None) -> torch.Tensor:
        positions = self.runner.adapter.text_positions(self.pos, 1)
        logits = self.runner.step(tokens[:, None], positions, self.cache, skip=self.skip, meter=meter)
        self.pos += 1
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)
        self.pos = self.pos[rows]
        if isinstance(self.skip, torch.Tensor):  # a per-sample plan follows its rows
            self.skip = self.skip.index_select(0, rows)
        elif isinstance(self.skip, LayerPlan):
            self.skip.rows(rows)

    def join(self, other: Decoding) -> None:
        a, b = fixed_skip(self.skip), fixed_skip(other.skip)
        if not (isinstance(a, frozenset | set) and isinstance(b, frozenset | set) and set(a) == set(b)):
            layers = self.runner.num_layers
            dev = self.pos.device
            a = torch.cat([skip_rows(a, len(self), layers).to(dev), skip_rows(b, len(other), layers).to(dev)])
        self.cache.join(other.cache)
        self.pos = torch.cat([self.pos, other.pos])
        self.skip = a


@torch.no_grad()
def generate(
    runner: Runner,
    prepared,
    plan: Plan | None = None,
    *,
    max_new_tokens: int,
    stop_ids: list[int] | None = None,
    pad_id: int = 0,
    sampling: Sampling | None = None,
    meter: Meter | None = None,
    forced: torch.Tensor | None = None,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
) -> GenerationOutput:
    """`Runner.prefill(prepared, plan)`, then decode with the plan's decode layers. `forced` [max_new_tokens]:
    the token every row takes at each step (teacher forcing); `on_logits(t, logits)`: shown each step's logits
    [live rows, V] before the choice. A sample that stops leaves the batch (its cache rows and the columns no
    live row uses are dropped), so decode FLOPs, KV bytes and time are those of the live rows only."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = sampling or Sampling()
    plan = plan or Plan()
    meter = meter or Meter(device=runner.device)
    dev = runner.device
    gen = torch.Generator(device=dev).manual_seed(sampling.seed) if sampling.temperature > 0 else None
    meter.start_memory()
    out = runner.prefill(prepared, plan, meter=meter)
    b = prepared.batch
    stops = torch.tensor(stop_ids or [], dtype=torch.long, device=dev)
    tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    lengths = torch.zeros(b, dtype=torch.long, device=dev)
    live = torch.arange(b, device=dev)  # rows of the batch still decoding, in cache order
    rows, logits = Decoding(runner, out.cache, out.next_pos.clone(), plan.skip_decode), out.logits
    counts = torch.zeros_like(logits) if sampling.penalized else None  # [B, V] generated so far, per row
    with meter.timer("decode"):
        for t in range(max_new_tokens):
            if on_logits is not None:
                on_logits(t, logits)
            if forced is None:
                tok = choose(logits, sampling, gen, None if counts is None else counts.index_select(0, live))
            else:
                tok = forced[t].to(dev).expand(len(live))
            if counts is not None:
                counts[live, tok] += 1
            tokens[live, t] = tok
            lengths[live] += 1
            done = torch.isin(tok, stops)
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            if bool(done.any()):
                meter.kv_end(rows.cache)  # the cache is at its largest just before rows leave
                stay = torch.nonzero(~done).flatten()
                rows.keep(stay)
                live, tok = live[stay], tok[stay]
            logits = rows.step(tok, meter)
    meter.kv_end(rows.cache)
    meter.stop_memory()
    return GenerationOutput(tokens[:, : int(lengths.max())], lengths, out.logits, meter.costs)
