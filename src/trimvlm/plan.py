"""Turn a Recipe's methods into what the runner executes: a token hook, a KV step at the prefill/decode
boundary, and the layers to skip in each phase."""

from __future__ import annotations

from dataclasses import dataclass, field

from trimvlm.recipe import Recipe, parse_recipe


@dataclass
class Plan:
    recipe: Recipe
    hook: object | None = None  # (layer_idx, seq, runner) -> seq
    after_prefill: object | None = None  # (PrefillOutput) -> None
    skip_prefill: frozenset[int] = field(default_factory=frozenset)
    skip_decode: frozenset[int] = field(default_factory=frozenset)
    skip_branch: frozenset[int] = field(default_factory=frozenset)  # candidate branches (scoring)
    probe: object | None = None  # AttentionProbe the prefill must record (union of what the methods ask)


def make_plan(recipe, runner) -> Plan:
    recipe = parse_recipe(recipe)
    methods = recipe.build()
    plan = Plan(recipe=recipe)
    reducer = methods.get("tokens")
    if reducer is not None:
        reducer.check(runner)
        plan.hook = reducer.hook(runner)
        plan.probe = reducer.probe(runner)
    policy = methods.get("kv")
    if policy is not None:
        plan.after_prefill = policy.bind(runner, reducer)
        wanted = policy.probe(runner)
        plan.probe = wanted.merge(plan.probe) if wanted is not None else plan.probe
    depth = methods.get("depth")
    if depth is not None:
        skips = depth.skips(runner)
        plan.skip_prefill, plan.skip_decode, plan.skip_branch = (
            skips["prefill"],
            skips["decode"],
            skips["branch"],
        )
    return plan
