"""A depth method names layers to skip and the scope they are skipped in: `all`, `prefill`, `decode` or
`candidates` (scoring branches only; the prefix always runs every layer). A skipped block is not executed and
writes no KV."""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

from trimvlm.errors import RecipeError
from trimvlm.options import check_options
from trimvlm.protocol import Method

SCOPES = {
    "all": ("prefill", "decode", "branch"),
    "prefill": ("prefill",),
    "decode": ("decode",),
    "candidates": ("branch",),
}


@dataclass
class DepthMethod(Method):
    scope: str = "all"

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise RecipeError(f"depth scope {self.scope!r} unknown; allowed: {', '.join(SCOPES)}")
        check_options(self)

    def skipped(self, runner) -> frozenset[int]:  # pragma: no cover - every method overrides it
        """The one hook: the layers skipped on this model."""
        raise NotImplementedError

    def apply(self, plan, runner) -> None:
        """The method protocol: the layers each phase skips."""
        skips = self.skips(runner)
        plan.skip_prefill, plan.skip_decode, plan.skip_branch = skips["prefill"], skips["decode"], skips["branch"]

    def skips(self, runner) -> dict[str, frozenset[int]]:
        layers = self.skipped(runner)
        runner.check_layers(layers, "skipped layer")
        return {
            p: (layers if p in SCOPES[self.scope] else frozenset()) for p in ("prefill", "decode", "branch")
        }


def check_budget(budget: int, num_layers: int) -> None:
    """A budget skips `budget` blocks; at least one block must run, so it must be below the layer count."""
    if budget >= num_layers:
        raise RecipeError(f"budget {budget} must be below the layer count {num_layers} (0..{num_layers - 1})")


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its fingerprint


def model_fingerprint(adapter) -> str:
    """A short fingerprint of a model (its family, text config and the sum of its first block's weights), saved
    in ranking files so that a ranking is never applied to another model. Computed once per loaded model (the
    float64 sum of layer 0 is not repeated on every plan): a loaded model's weights are not trained in place."""
    model = adapter.model
    if model not in _FINGERPRINTS:
        _FINGERPRINTS[model] = _fingerprint(adapter)
    return _FINGERPRINTS[model]


def _fingerprint(adapter) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(adapter.family.encode())
    h.update(adapter.text_config.to_json_string(use_diff=False).encode())
    first = sum(float(p.detach().double().sum()) for p in adapter.layers[0].parameters())
    h.update(f"{first:.6e}".encode())
    return h.hexdigest()
