"""A routed prefill (`Plan.routes`): a router sends each row of the batch to one of several plans, and each group
of rows runs as a batch of its own.

Rows whose tokens are reduced at different layers, or to different counts, would pad one another in one batch:
every layer runs (and is counted) at the batch's longest row. So the batch is embedded once (the vision tower
runs once), each group's rows are taken out and compacted to their own longest row, and the group runs the
decoder under its plan on a cache of its own (its token hook, its layers), finished as any prefill is
(`Prefill.finish`: logits, its KV step at the boundary). The caches are then joined and put back in the
batch's row order, and the decode runs the batch as one, each row with its group's decode layers. FLOPs are
booked per group on the one meter, so they sum to the groups run apart. The output's `seq` is None: the groups'
final sequences have different lengths.
"""

from __future__ import annotations

import torch

from trimvlm.errors import TrimVLMError
from trimvlm.runtime.cache import KVCache, PrefillOutput
from trimvlm.runtime.plan import fixed_skip, skip_rows


def prefill_routes(work) -> PrefillOutput:
    """The routed prefill of `work` (a `runtime.runner.Prefill` whose plan has routes), the whole prompt at once."""
    if work.all_logits:
        raise TrimVLMError("a routed prefill gives each row's last logits only: its groups' lengths differ")
    runner, meter, seq = work.runner, work.meter, work.seq
    parts, plans, order = [], [], []
    for group in work.plan.routes(seq, runner):
        rows, plan = group.rows, group.plan
        if plan.vision_probe is not None:
            raise TrimVLMError(f"{plan.label()}: a routed group cannot read the vision tower's attention")
        sub = seq.take_rows(rows)
        sub = sub.gather(sub.valid)  # compacted to the group's own longest row
        cache = KVCache(runner.num_layers)
        with meter.timer("prefill"):
            out = runner.run(sub, cache, phase="prefill", hook=plan.hook, skip=plan.skip_prefill, meter=meter,
                             ctx=plan.attention_context())  # fmt: skip
        parts.append(work.finish(out, cache, work.next_pos.index_select(0, rows), plan))
        plans.append(plan)
        order.append(rows)
    return _joined(work, parts, plans, torch.cat(order))


def _joined(work, parts: list[PrefillOutput], plans: list, order: torch.Tensor) -> PrefillOutput:
    """The groups' outputs as one batch in the original row order; the plan's decode layers per row."""
    cache = parts[0].cache
    for part in parts[1:]:
        cache.join(part.cache)
    back = torch.argsort(order)
    cache.keep_rows(back.to(work.runner.device))
    skips = [fixed_skip(plan.skip_decode) for plan in plans]
    if all(isinstance(s, frozenset | set) and not s for s in skips):
        work.plan.skip_decode = frozenset()
    else:
        layers = work.runner.num_layers
        per_row = [skip_rows(s, len(p.next_pos), layers).cpu() for s, p in zip(skips, parts, strict=True)]
        work.plan.skip_decode = torch.cat(per_row).index_select(0, back).to(work.runner.device)
    logits = None
    if work.lm_head:
        logits = torch.cat([p.logits for p in parts]).index_select(0, back.to(parts[0].logits.device))
    work.meter.kv(cache)
    return PrefillOutput(logits=logits, seq=None, cache=cache, next_pos=work.next_pos)
