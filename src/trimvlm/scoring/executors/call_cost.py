"""What one extra kernel call costs the `tree` executor, in token slots of a layer, measured on the model itself.

The layout's cost model (`tree_layout.layout_price`) counts token slots and extra kernel calls (the ancestor
part of an attention layer, one more recurrent call per level). Their exchange rate depends on the model's
width, the kernels and the threads, so it is measured, once per model, device, thread count and skipped-layer
set, at the executor's first use, on the request's own prefix cache (read-only), with three tiny layouts of
two candidates of L tokens (`_length`: 16, or what keeps every probe on one recurrent kernel path):

    P1  plain rows 2 x L           (the `batched` layout)
    P2  plain rows 2 x 2L
    T   a root of L with two children of L, as the merged trie layout (one extra call per layer)

Interleaved rounds after a warm-up (the median of each; at most ROUNDS, fewer when a round is slow, so the
whole measurement stays near BUDGET_S; on a model so wide that the warm-up alone takes half of it, the warm-up
is the measurement): the slope s = (P2 - P1) / (slots(P2) - slots(P1)) is the price of a slot, the rest of
P1 the fixed cost of a pass, and call_cost = (T - fixed - s * slots(T)) / (s * calls(T)), clamped to
[0, MAX_CALL_COST].
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref

import torch

from trimvlm.runtime.meter import Meter
from trimvlm.scoring.executors.common import Work
from trimvlm.scoring.executors.tree_layout import LayerMix, layout_price, merged_layout, plan_pieces
from trimvlm.scoring.executors.tree_schedule import run_pieces
from trimvlm.scoring.trie import build_forest

ROUNDS = 5
BUDGET_S = 0.3
MAX_CALL_COST = 1024.0
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(device, threads, skip): cost}


def measured(model) -> dict:
    """{(device, threads, skip): call cost} measured so far for `model`."""
    return dict(_CACHE.get(model, {}))


def call_cost(work: Work, mix: LayerMix) -> float:
    """The measured price of one extra kernel call, in token slots (cached; see the module docstring)."""
    model = work.runner.adapter.model
    key = (str(work.device), torch.get_num_threads(), work.skip)
    per_model = _CACHE.setdefault(model, {})
    if key not in per_model:
        per_model[key] = measure(work, mix)
    return per_model[key]


def _length(mix: LayerMix) -> int:
    """Candidate length L of the probes: every probe row (up to 2L) on one recurrent path — the short form
    when the kernel has one (L = short // 2), else whole chunks (L = chunk) — and 16 for attention-only."""
    if mix.recurrent and mix.short >= 8:
        return mix.short // 2
    return max(16, mix.chunk) if mix.recurrent else 16


def measure(work: Work, mix: LayerMix) -> float:
    length = _length(mix)
    start = work.forest.starts[0]
    root = [1] * length

    def sfx(i, n):  # a candidate of n tokens whose first token tells it from its siblings
        return [2 + i] + [1] * (n - 1)

    p1 = build_forest([[sfx(i, length) for i in range(2)]], [start], merge=False)
    p2 = build_forest([[sfx(i, 2 * length) for i in range(2)]], [start], merge=False)
    t = build_forest([[root + sfx(i, length) for i in range(2)]], [start], merge=True)
    free = dataclasses.replace(mix, call_cost=0.0)
    layouts = {
        "p1": (p1, plan_pieces(p1, free)),
        "p2": (p2, plan_pieces(p2, free)),
        "t": (t, merged_layout(t, free)),
    }
    price = {k: layout_price(pieces, f, free) for k, (f, pieces) in layouts.items()}
    times: dict[str, list[float]] = {k: [] for k in layouts}
    spent = time.perf_counter()
    for r in range(ROUNDS + 1):  # round 0 warms up (and is the measurement when it alone is slow)
        for k, (f, pieces) in layouts.items():
            sub = Work(work.runner, work.prefix, f, work.skip, Meter(device=work.device), work.plan)
            t0 = time.perf_counter()
            run_pieces(sub, pieces, free)
            times[k].append(time.perf_counter() - t0)
        took = time.perf_counter() - spent
        if r == 0 and took <= BUDGET_S / 2:
            times = {k: [] for k in layouts}  # a cheap warm-up: measure from the next round
        elif took > BUDGET_S:
            break
    med = {k: statistics.median(v) for k, v in times.items()}
    slots = {k: p.slots for k, p in price.items()}
    slope = (med["p2"] - med["p1"]) / max(1e-9, slots["p2"] - slots["p1"])
    if slope <= 0:  # noise swamped the slope: keep the default
        return mix.call_cost
    fixed = med["p1"] - slope * slots["p1"]
    extra = (med["t"] - fixed - slope * slots["t"]) / (slope * max(1e-9, price["t"].calls))
    return float(min(MAX_CALL_COST, max(0.0, extra)))
