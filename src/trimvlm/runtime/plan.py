"""What the runner executes for a recipe: a `Plan` (built from a `Recipe` by `trimvlm.plan.make_plan`).

The plan is data the runner applies, every caller the same way: the token hook before each layer, the layers to
skip in each phase (a set, or a per-sample `LayerPlan`), what the prefill's attention must record, and the KV
step at the prefill/decode boundary. `Handoff` carries what one phase hands the next within one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from trimvlm.errors import RecipeError
from trimvlm.runtime.attention import AttentionContext


@dataclass
class Handoff:
    """What one phase hands the next within one call, filled in as the call runs (methods keep no state):

    probes: the AttentionProbe each axis asked for ("tokens", "kv"), read back by that axis' method;
    rho: [B, S_prefill] float, the prefill reducer's spatial density by original position (NaN off its visual
        tokens), for a KV policy that reuses it;
    kept: [B, S_prefill] bool, the original positions the prefill reducer kept (None: no reduction ran);
    vision: vision-tower attention rows recorded while the images were encoded (PruMerge, VisionZip);
    router: [B, S] the meta-router's keep score of every visual token, by column (-inf elsewhere).
    What a method carries from one of its own phases to the next (SparseVLM's raters, FitPrune's fractions) is
    the method's own state, never a field here.
    """

    probes: dict = field(default_factory=dict)
    rho: object | None = None
    kept: object | None = None
    vision: object | None = None
    router: object | None = None


@dataclass(eq=False)
class LayerPlan:
    """A per-sample layer plan decided during the prefill (by the meta-router, before the first layer runs):
    `plan` [B, num_layers] bool (True: that sample skips that layer) once set; nothing is skipped before."""

    plan: torch.Tensor | None = None

    def rows(self, stay: torch.Tensor) -> None:
        """Keep the plan of batch rows `stay` only (rows that stopped decoding left the batch)."""
        if self.plan is not None:
            self.plan = self.plan.index_select(0, stay)


def fixed_skip(skip):
    """A `LayerPlan` as what it holds (its [B, L] plan, or nothing skipped before one was set); else `skip`."""
    if isinstance(skip, LayerPlan):
        return frozenset() if skip.plan is None else skip.plan
    return skip


def skip_rows(skip, rows: int, layers: int) -> torch.Tensor:
    """[rows, layers] bool: a set of skipped layers (or a [rows, L] plan, returned as it is) for every row."""
    if isinstance(skip, torch.Tensor):
        return skip
    out = torch.zeros(rows, layers, dtype=torch.bool)
    out[:, sorted(int(i) for i in skip)] = True
    return out


class RouteGroup(NamedTuple):
    """The rows of a batch a routed plan sends to one route, and the route's plan for them."""

    rows: torch.Tensor  # [n] long: the rows, in batch order
    plan: Plan


@dataclass
class Plan:
    recipe: object = None  # the trimvlm.recipe.Recipe it was built from (None: a plan made by hand)
    hook: object | None = None  # (layer_idx, seq, runner) -> seq
    after_prefill: object | None = None  # (PrefillOutput) -> None: the KV policy at the boundary
    skip_prefill: object = field(default_factory=frozenset)  # a set of layers, a [B, L] bool, or a LayerPlan
    skip_decode: object = field(default_factory=frozenset)
    skip_branch: object = field(default_factory=frozenset)  # candidate branches (scoring)
    probe: object | None = None  # AttentionProbe the prefill must record (union of what the methods ask)
    vision_probe: object | None = None  # what the image encoding must record in the vision tower, or None
    # (h, w) -> (h', w'): the LLM token grid each image is prepared at (tokens=downsample); applied by
    # `vlm.prepare(..., plan=)` through `adapters.base.resolution`, checked by the runner
    resolution: object | None = None
    handoff: Handoff = field(default_factory=Handoff)
    # (seq, runner) -> [RouteGroup]: each group of the batch's rows runs under its own plan, as a batch of its
    # own (runtime/routes.py); the router's routed variants
    routes: object | None = None

    @property
    def per_sample(self) -> bool:
        """Whether the prefill's layer plan, or the plan itself (routes), differs per sample (the router's)."""
        return self.routes is not None or isinstance(self.skip_prefill, LayerPlan | torch.Tensor)

    @property
    def chunkable(self) -> bool:
        """Whether a prefill under this plan may run in chunks (`Runner.prefill_chunked`): nothing in it reads the
        whole prompt at once (no token hook, KV step at the boundary, attention probe or per-sample plan)."""
        return self.hook is None and self.after_prefill is None and self.attention_context() is None and not self.per_sample

    @property
    def reuses_prompts(self) -> bool:
        """Whether a prompt's prefill under this plan may be stored and reused (runtime/prefix_cache.py): its KV
        is not changed at the boundary by a policy that keeps state for the decode, and no per-sample plan."""
        return self.after_prefill is None and not self.per_sample

    def refuse_routes(self, what: str) -> None:
        """A clear error where `what` reads one prefill of the whole batch, which a routed plan does not make."""
        if self.routes is not None:
            raise RecipeError(f"{self.label()} runs each input on one of its routes (a routed router variant), in "
                              f"generation only: {what} reads one prefill of the whole batch; give the router "
                              "select= and price= to run one variant")  # fmt: skip

    def label(self) -> str:
        return "baseline" if self.recipe is None else self.recipe.label()

    def attention_context(self):
        """The AttentionContext a prefill needs to record what the methods asked for (None: nothing)."""
        if self.probe is None and self.vision_probe is None:
            return None
        return AttentionContext(probe=self.probe, vision=self.vision_probe)
