"""The vision-feature cache: per image, what the vision tower returned for it, reused by later requests.

Keyed by the image's content after the processor (its pixel tensor and grid, so the processor's settings are in
the key through what they produced) and the model's fingerprint (`Adapter.fingerprint`: family, config, dtype,
device, processor settings). Bounded in bytes, least recently used entries evicted first (`lru.ByteLRU`). An
adapter that reads it (`Adapter.caches_vision`) hands `features` its images and a function that encodes a subset
of them; only the images not found are encoded, in one call. The FLOPs booked are those of that call: counted by
torch's FlopCounterMode the first time its shapes are seen and remembered in the runner's `FlopsMemo`, 0 when every
image was found. Off unless turned on (`VLM.use_caches`, `trimvlm serve`): evaluations never read it.

Exact: a hit returns the very tensors the tower produced for that image (an image's features do not depend on
the other images of its call in the packed Qwen-VL towers, up to floating-point summation order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trimvlm.runtime.lru import ByteLRU, digest
from trimvlm.runtime.meter import FlopsMemo


class VisionCache(ByteLRU):
    def __init__(self, max_bytes: int, fingerprint: str, flops: FlopsMemo):
        super().__init__(max_bytes, "vision cache")
        self.fingerprint = fingerprint
        self.flops = flops  # the runner's memo (`Runner.flops`): a miss call's FLOPs by its shapes
        self.last_flops = 0  # the vision FLOPs of the last `features` call (0: every image was found)
        self.last_hits: list[bool] = []  # per image of the last call, whether it was found

    def features(
        self,
        images: list[tuple[torch.Tensor, torch.Tensor]],
        encode: Callable[[list[int]], list[tuple[torch.Tensor, ...]]],
    ) -> list[tuple[torch.Tensor, ...]]:
        """Per image `(pixels, grid)`, its features (a tuple of tensors, the family's per-image outputs);
        `encode(indices)` runs the tower on those images only, returning their features in that order."""
        keys = [digest(self.fingerprint, grid, pixels) for pixels, grid in images]
        found = [self.get(k) for k in keys]
        miss = [i for i, f in enumerate(found) if f is None]
        self.last_hits = [f is not None for f in found]
        self.last_flops = 0
        if not miss:
            return found
        shape = ("vision cache", *((tuple(images[i][0].shape), tuple(images[i][1].tolist())) for i in miss))
        parts, self.last_flops = self.flops.run(shape, lambda: encode(miss))
        for i, part in zip(miss, parts, strict=True):
            own = tuple(t.clone() for t in part)  # not a view that would hold the whole call's output alive
            self.put(keys[i], own)
            found[i] = own
        return found
