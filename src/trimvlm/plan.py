"""Turn a Recipe's methods into what the runner executes: a token hook, a KV step at the prefill/decode
boundary, and the layers to skip in each phase."""

from __future__ import annotations

from dataclasses import dataclass, field

from trimvlm.errors import RecipeError
from trimvlm.recipe import Recipe, parse_recipe


@dataclass
class Handoff:
    """What one phase hands the next within one call, filled in as the call runs (methods keep no state):

    probes: the AttentionProbe each axis asked for ("tokens", "kv"), read back by that axis' method;
    rho: [B, S_prefill] float, the prefill reducer's spatial density by original position (NaN off its visual
        tokens), for a KV policy that reuses it;
    kept: [B, S_prefill] bool, the original positions the prefill reducer kept (None: no reduction ran);
    vision: vision-tower attention rows recorded while the images were encoded (PruMerge, VisionZip);
    router: [B, S] the meta-router's keep score of every visual token, by column (-inf elsewhere).
    """

    probes: dict = field(default_factory=dict)
    rho: object | None = None
    kept: object | None = None
    vision: object | None = None
    router: object | None = None


@dataclass
class Plan:
    recipe: Recipe
    hook: object | None = None  # (layer_idx, seq, runner) -> seq
    after_prefill: object | None = None  # (PrefillOutput) -> None
    skip_prefill: frozenset[int] = field(default_factory=frozenset)
    skip_decode: frozenset[int] = field(default_factory=frozenset)
    skip_branch: frozenset[int] = field(default_factory=frozenset)  # candidate branches (scoring)
    probe: object | None = None  # AttentionProbe the prefill must record (union of what the methods ask)
    vision_probe: object | None = None  # what the image encoding must record in the vision tower, or None
    handoff: Handoff = field(default_factory=Handoff)

    def attention_context(self):
        """The AttentionContext a prefill needs to record what the methods asked for (None: nothing)."""
        if self.probe is None and self.vision_probe is None:
            return None
        from trimvlm.runtime.attention import AttentionContext

        return AttentionContext(probe=self.probe, vision=self.vision_probe)


def make_plan(recipe, runner) -> Plan:
    recipe = parse_recipe(recipe)
    methods = recipe.build()
    plan = Plan(recipe=recipe)
    reducer = methods.get("tokens")
    if reducer is not None:
        reducer.check(runner)
        plan.hook = reducer.hook(runner, plan.handoff)
        plan.probe = reducer.probe(runner, plan.handoff)
        plan.vision_probe = reducer.vision_probe(runner, plan.handoff)
    policy = methods.get("kv")
    if policy is not None:
        plan.after_prefill = policy.bind(runner, plan.handoff)
        wanted = policy.probe(runner, plan.handoff)
        plan.probe = wanted.merge(plan.probe) if wanted is not None else plan.probe
    router = methods.get("router")
    if router is not None:
        for other in ("tokens", "depth"):
            if other in methods:
                raise RecipeError(
                    f"router= picks the visual tokens and the skipped layers itself; do not combine it with {other}="
                )
        router.check(runner)
        plan.hook, plan.skip_prefill = router.bind(runner, plan.handoff)
        plan.skip_decode = plan.skip_prefill
    depth = methods.get("depth")
    if depth is not None:
        skips = depth.skips(runner)
        plan.skip_prefill, plan.skip_decode, plan.skip_branch = (
            skips["prefill"],
            skips["decode"],
            skips["branch"],
        )
    return plan
