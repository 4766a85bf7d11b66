"""Router training's layouts run as a trie: layouts that agree on their first layers share those layers' work.

A layout (`Layout`) keeps each image's top `keep` visual tokens by one of the input's token score rows before
the router's layer K and skips a set of layers (in the prompt and the answer alike). Two layouts of one input
run the same computation up to the first layer where they differ: the same tokens (before K every layout holds
all of them) and the same skipped layers so far. So the layer loop runs once per trie node, not once per layout:

- the answer is teacher-forced (the unpruned model's greedy answer), so the prompt and the answer run as one
  chunk, causal, the answer's tokens after the prompt at the positions a decode would give them; the logits
  at the prompt's last position and the answer's tokens are the layout's next-token distributions along the
  answer, as the prefill and its forced decode steps give them (to float rounding);
- the vision tower runs once per input, and layers 0..K-1 once for all of its layouts;
- before layer K the rows fork by token selection (rows with one keep run together, so no row is padded to
  a longer one: one `Runner.run` per keep from layer K on);
- before every layer the rows fork where their layouts differ on skipping it; the rows that skip it are held
  aside, the others run it as one batch (`_Fork`, the runner's token hook), so the meter books each shared
  layer once, for the rows that ran it;
- at the end every leaf row is one distinct layout; the LM head runs on the answer's positions of all leaves
  as one batch, and each leaf's cost is the sum over the answer of KL(p_full || p_leaf).

`run_trie` takes a batch of inputs (ragged: images and prompts of different sizes, answers of different lengths)
and one list of layouts for all of them. With `reducer` (keep -> a token method, e.g. a router's `select=`
method) the tokens are that method's, as a recipe runs it (its merge included), rather than the top of a score row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trimvlm.errors import TrimVLMError
from trimvlm.kernels.flops import counting
from trimvlm.router.route import RouterTokens
from trimvlm.runtime.attention import AttentionContext
from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.plan import Handoff, LayerPlan
from trimvlm.runtime.sequence import LiveSeq, next_positions


@dataclass(frozen=True)
class Layout:
    """One layout: `keep` of each image's visual tokens kept before the router's layer, ranked by the input's
    token score row `tokens`; the layers in `skip` not run."""

    keep: float
    tokens: int
    skip: frozenset


@dataclass
class TrieOutput:
    """What `run_trie` measured."""

    cost: torch.Tensor  # [B, M] float64: sum over the answer of KL(p_full || p_layout) (zeros without p_full)
    logits: torch.Tensor | None  # [R, n, V] the leaves' logits along the answers (input b's: the last n_b), when asked
    leaf: torch.Tensor  # [B, M] the leaf row of each input's layout
    node_layers: int  # decoder-layer runs of one row the trie made
    layout_layers: int  # those its layouts would make apart (each layout's own rows, every layer it keeps)


@dataclass
class _Rows:
    """The trie's current nodes, one row each: the live sequence (with what the family adds after layers),
    per row its input, its layouts and how many layers it ran."""

    seq: LiveSeq
    inputs: list[int]
    sets: list[list[int]]
    ran: torch.Tensor  # [R] long, on the host

    def take(self, idx: list[int]) -> _Rows:
        return _Rows(self.seq.take_rows(idx), [self.inputs[j] for j in idx], [self.sets[j] for j in idx],
                     self.ran[idx])  # fmt: skip


@torch.no_grad()
def run_trie(runner, prepared, answers: list[torch.Tensor], scores: torch.Tensor, layouts: list[Layout],
             layer: int, p_full: list[torch.Tensor] | None = None, *, meter: Meter | None = None,
             keep_logits: bool = False, reducer=None) -> TrieOutput:  # fmt: skip
    """Run every layout of `layouts` on every input of `prepared` as one trie, teacher-forced on `answers`
    (per input its answer tokens [n_b]; `p_full` per input its unpruned log-probs along it [n_b, V]).
    `scores` [B, T, S]: per input its token score rows by column of the prepared (unreduced) sequence,
    -inf off the visual tokens (None with `reducer`); `layer`: the router's layer K, where tokens are dropped;
    `reducer`: keep -> the token method that reduces there instead (the layouts' `tokens` then unused)."""
    meter = meter or Meter(device=runner.device)
    reads = _Reads.request(runner, reducer, layouts, layer)
    seq = runner.encode(prepared, meter, reads.handoff.vision)
    by_source = None if reducer is not None else _by_source(seq, scores)
    b = seq.batch
    reads.record(runner, seq, layouts, layer, meter)
    seq = _with_answer(runner, seq, [a[:-1] for a in answers])
    rows = _Rows(seq, list(range(b)), [list(range(len(layouts)))] * b, torch.zeros(b, dtype=torch.long))
    executed = 0
    if layer > 0:
        rows, executed = _segment(runner, rows, layouts, 0, layer, meter)
    leaves = []
    tails = [len(a) - 1 for a in answers]
    for group in _token_fork(runner, rows, layouts, by_source, layer, meter, reducer, reads, tails):
        group, runs = _segment(runner, group, layouts, layer, runner.num_layers, meter)
        leaves.append(group)
        executed += runs
    inputs = [i for g in leaves for i in g.inputs]
    sets = [s for g in leaves for s in g.sets]
    leaf = torch.zeros(b, len(layouts), dtype=torch.long)
    for r, (i, s) in enumerate(zip(inputs, sets, strict=True)):
        leaf[i, s] = r
    hidden = torch.cat([g.seq.hidden[:, -max(len(a) for a in answers) :] for g in leaves])
    cost, logits = _score(runner, hidden, inputs, sets, answers, p_full, len(layouts), keep_logits, meter)
    apart = sum(runner.num_layers - len(m.skip) for m in layouts) * b
    return TrieOutput(cost, logits, leaf, executed, apart)


def _score(runner, hidden, inputs, sets, answers, p_full, m: int, keep_logits: bool, meter, chunk: int = 64):
    """The LM head on the leaves' answer positions (`hidden` [R, n, D]), `chunk` rows at a time (a large
    vocabulary times hundreds of leaves is not held at once unless `keep_logits`): (each of the M layouts'
    cost [B, M], the logits [R, n, V] or None)."""
    n, lens = hidden.shape[1], [len(a) for a in answers]
    cost = torch.zeros(len(answers), m, dtype=torch.float64)
    kept = []
    for a in range(0, hidden.shape[0], chunk):
        h = hidden[a : a + chunk]
        meter.add("prefill", runner.adapter.head_flops(h.shape[0], n))
        logits = runner.adapter.lm_head(h).float()
        if keep_logits:
            kept.append(logits)
        if p_full is None:
            continue
        for r in range(a, a + h.shape[0]):
            i = inputs[r]
            q = torch.log_softmax(logits[r - a, n - lens[i] :].double(), -1)
            p = p_full[i].to(q.device)
            cost[i, sets[r]] = float((p.exp() * (p - q)).sum())
    return cost, torch.cat(kept) if keep_logits else None


def _segment(runner, rows: _Rows, layouts, start: int, stop: int, meter, probe=None) -> tuple[_Rows, int]:
    """Run layers start..stop-1 over the trie's rows (one `Runner.run`, forking as the layouts diverge): (the
    rows entering layer `stop`, final-normed when it is the end; the layer runs of one row it made). `probe`:
    an AttentionProbe recording as they run."""
    fork = _Fork(rows, layouts, stop)
    cache = KVCache(runner.num_layers)
    cache.keep_kv = False  # one chunk: each layer reads only its own keys
    ctx = None if probe is None else AttentionContext(probe=probe)
    out = runner.run(
        _bare(rows.seq), cache, phase="prefill", hook=fork, skip=fork.plan, meter=meter, ctx=ctx, start=start
    )
    if stop == runner.num_layers:
        fork.rows.seq = fork.rows.seq.with_hidden(out.hidden)
    return fork.rows, fork.executed


class _Fork:
    """The runner's token hook over one trie segment: before layer i it takes the rows that ran layer i-1
    back (adding what the family adds after a layer, by each row's own count of layers run), splits the rows
    whose layouts differ on layer i, and hands the runner only the rows that run it (none: the layer is
    skipped). What the family adds is applied here, never by the runner, whose batch changes as rows fork."""

    def __init__(self, rows: _Rows, layouts, stop: int):
        self.rows, self.layouts, self.stop = rows, layouts, stop
        self.plan = LayerPlan()
        self.running: list[int] | None = None  # the rows handed to the runner for the last layer
        self.executed = 0  # layer runs of one row

    def __call__(self, i: int, seq: LiveSeq, runner) -> LiveSeq:
        if i > self.stop:
            return seq
        prev = self.running
        if prev is not None:
            self._took(seq.hidden, runner)
        if i == self.stop:
            if i < runner.num_layers:
                self.plan.plan = torch.ones(seq.batch, runner.num_layers, dtype=torch.bool)
            return _bare(self.rows.seq) if i == runner.num_layers else seq
        forked = self._split(i)
        run = [r for r, s in enumerate(self.rows.sets) if i not in self.layouts[s[0]].skip]
        self.running = run or None
        self.executed += len(run)
        if not run:  # every row skips layer i
            self.plan.plan = torch.ones(seq.batch, runner.num_layers, dtype=torch.bool)
            return seq
        self.plan.plan = None
        every = len(run) == len(self.rows.sets)
        if every and prev == run and not forked and not self.rows.seq.adds:
            return seq  # the rows that ran the last layer, unchanged: the runner keeps its sequence
        return _bare(self.rows.seq if every else self.rows.seq.take_rows(run))

    def _took(self, hidden: torch.Tensor, runner) -> None:
        """The output of the last layer for the rows that ran it."""
        rows, run = self.rows, self.running
        every = len(run) == len(rows.sets)
        if rows.seq.adds:
            hidden = runner.adapter.after_layer(
                rows.ran[run], rows.seq if every else rows.seq.take_rows(run), hidden
            )
        if not every:
            hidden = rows.seq.hidden.index_copy(0, torch.tensor(run, device=hidden.device), hidden)
        rows.seq = rows.seq.with_hidden(hidden)
        rows.ran[run] += 1
        self.running = None

    def _split(self, i: int) -> bool:
        """Fork every row whose layouts differ on skipping layer i into its runs-it and skips-it rows."""
        parents, sets = [], []
        for r, s in enumerate(self.rows.sets):
            for part in ([m for m in s if (i in self.layouts[m].skip) == skips] for skips in (False, True)):
                if part:
                    parents.append(r)
                    sets.append(part)
        if len(sets) == len(self.rows.sets):
            return False
        self.rows = self.rows.take(parents)
        self.rows.sets = sets
        return True


def _token_fork(runner, rows: _Rows, layouts, by_source, layer: int, meter, reducer, reads, tails) -> list[_Rows]:
    """Fork the rows entering the router's layer by token selection: per keep, one group of rows (each a
    distinct (row, token score row); keep 1 drops nothing, whatever the row), its tokens dropped (by the top
    of its score row, or by `reducer(keep)`)."""
    groups: dict[float, dict] = {}
    for r, s in enumerate(rows.sets):
        for m in s:
            k = min(float(layouts[m].keep), 1.0)
            key = (r, layouts[m].tokens if k < 1 and reducer is None else -1)
            groups.setdefault(k, {}).setdefault(key, []).append(m)
    out = []
    for k, kids in sorted(groups.items()):
        child = rows.take([r for r, _ in kids])
        child.sets = list(kids.values())
        if k < 1:
            with counting(meter, "prefill"):
                child.seq = _reduce_prompt(runner, child, [t for _, t in kids], k, by_source, layer, reducer,
                                           reads, tails)  # fmt: skip
        out.append(child)
    return out


def _reduce_prompt(runner, rows: _Rows, tokens, keep: float, by_source, layer: int, reducer, reads, tails):
    """The rows' sequence with its prompt reduced as a prefill reduces it (the reducer sees the prompt alone,
    the forced answer after it is kept whole): by the top of each row's score row `tokens[r]`, or by
    `reducer(keep)`, reading what `reads` recorded."""
    seq = rows.seq
    n = max(tails[i] for i in rows.inputs)
    cols = torch.arange(seq.length, device=seq.hidden.device)
    answer = cols[None] >= seq.length - torch.tensor([tails[i] for i in rows.inputs], device=cols.device)[:, None]
    prompt = seq.gather(~answer)
    if reducer is None:
        score = by_source[torch.tensor(rows.inputs), torch.tensor(tokens)]
        score = score.gather(1, prompt.source.clamp(min=0)).masked_fill(prompt.source < 0, float("-inf"))
        prompt = RouterTokens(keep=keep, layer=layer).reduce(prompt, runner, Handoff(router=score))
    else:
        prompt = reducer(keep).reduce(prompt, runner, reads.for_rows(rows.inputs), layer)
    tail = cols[seq.length - n :].expand(seq.batch, n)
    return _joined(prompt, seq.index_select(tail, answer[:, seq.length - n :]))


@dataclass
class _Reads:
    """What a token method reads besides the sequence, recorded once for every input: the vision tower's
    attention (while the images are encoded) and the prompt's own attention in the layer before the method's."""

    handoff: Handoff

    @classmethod
    def request(cls, runner, reducer, layouts, layer: int) -> _Reads:
        handoff = Handoff()
        keeps = [m.keep for m in layouts if m.keep < 1]
        if reducer is None or not keeps:
            return cls(handoff)
        method = reducer(min(keeps))
        if len(method.stages(runner)) > 1:
            raise TrimVLMError(f"tokens={method.name} reduces before several layers: the layout trie reduces once")
        if method.probe(runner, handoff) is not None and any(min(m.skip, default=layer) < layer for m in layouts):
            raise TrimVLMError(f"tokens={method.name} reads layer {layer - 1}'s attention: no layout may skip a "
                               f"layer before {layer}")  # fmt: skip
        method.vision_probe(runner, handoff)
        return cls(handoff)

    def record(self, runner, seq: LiveSeq, layouts, layer: int, meter) -> None:
        """Run the prompt alone (`seq`, encoded) up to `layer`, recording the attention the method reads (the
        rows of the prompt's last queries, as its prefill records them)."""
        probe = self.handoff.probes.get("tokens")
        if probe is not None:
            rows = _Rows(seq, list(range(seq.batch)), [[0]] * seq.batch, torch.zeros(seq.batch, dtype=torch.long))
            _segment(runner, rows, layouts[:1], 0, layer, meter, probe)

    def for_rows(self, inputs: list[int]) -> Handoff:
        """A handoff holding the rows' records (row r: input `inputs[r]`'s)."""
        out = Handoff()
        probe = self.handoff.probes.get("tokens")
        if probe is not None:
            idx = torch.tensor(inputs)
            taken = {i: t.index_select(0, idx.to(t.device)) for i, t in probe.results.items()}
            out.probes["tokens"] = replace(probe, results=taken, row_valid={})
        v = self.handoff.vision
        if v is not None:
            out.vision = replace(v, results={(r, u): rec for r, i in enumerate(inputs)
                                             for (b, u), rec in v.results.items() if b == i})  # fmt: skip
        return out


def _by_source(seq: LiveSeq, scores: torch.Tensor) -> torch.Tensor:
    """[B, T, S] the score rows by the tokens' original index (`source`) rather than their column."""
    b, t, s = scores.shape
    scores = scores.to(seq.hidden.device)
    src = seq.source.masked_fill(seq.source < 0, s)[:, None].expand(b, t, s)  # padding: a spare column
    return scores.new_full((b, t, s + 1), float("-inf")).scatter(2, src, scores)[..., :s]


def _with_answer(runner, seq: LiveSeq, inputs: list[torch.Tensor]) -> LiveSeq:
    """`seq` with each row's forced answer tokens `inputs[b]` after its prompt, at the positions a decode
    would give them, left-padded again."""
    n = max(len(a) for a in inputs)
    if n == 0:
        return seq
    b, dev = seq.batch, seq.hidden.device
    ids = torch.zeros(b, n, dtype=torch.long, device=dev)
    valid = torch.zeros(b, n, dtype=torch.bool, device=dev)
    for r, a in enumerate(inputs):
        ids[r, : len(a)], valid[r, : len(a)] = a.to(dev), True
    positions = runner.adapter.text_positions(next_positions(seq.positions, seq.valid), n)
    tail = LiveSeq.text(runner.adapter.embed_tokens(ids).to(seq.hidden.dtype), positions.to(seq.positions.dtype), valid)
    return _joined(seq, tail)


def _joined(seq: LiveSeq, tail: LiveSeq) -> LiveSeq:
    """Each row of `seq` followed by its row of `tail` (what the family adds, and sizes: zeros and ones where
    `tail` has none), left-padded again."""
    b, n = tail.batch, tail.length

    def cat(k):
        return torch.cat([getattr(seq, k), getattr(tail, k)], dim=2 if k == "positions" else 1)

    joined = {k: cat(k) for k in ("hidden", "positions", "valid", "visual", "source", "image_id")}
    joined["adds"] = {}
    for k, ts in seq.adds.items():
        more = tail.adds.get(k) or [t.new_zeros(b, n, *t.shape[2:]) for t in ts]
        joined["adds"][k] = [torch.cat([t, u], 1) for t, u in zip(ts, more, strict=True)]
    if seq.size is not None or tail.size is not None:
        joined["size"] = torch.cat([torch.ones_like(x.valid, dtype=torch.long) if x.size is None else x.size
                                    for x in (seq, tail)], 1)  # fmt: skip
    full = replace(seq, **joined)
    return full.gather(full.valid)


def _bare(seq: LiveSeq) -> LiveSeq:
    """`seq` without what the family adds after layers (the trie's hook adds it, by each row's own count)."""
    return replace(seq, adds={}) if seq.adds else seq
