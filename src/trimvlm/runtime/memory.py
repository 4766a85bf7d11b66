"""Peak tensor memory on any device, measured on the tensors themselves.

`TensorMemory` is a torch dispatch mode: every storage an operation allocates while it is active is counted
when it appears and uncounted when it is freed (a finalizer on the storage), so `peak` is the largest total of
live tensor bytes allocated inside the region (weights and anything allocated before it are not counted, and
nothing depends on what the process touched earlier). Views and in-place results share a storage and are
counted once. The bookkeeping runs on every operation: measure memory in a run of its own, not a timed one.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._section_base = 0
        self._section_peak = 0

    def start_section(self) -> None:
        """Measure a part of the region from here: `end_section` gives its peak over the live bytes now."""
        self._section_base = self._section_peak = self.live

    def end_section(self) -> int:
        return self._section_peak - self._section_base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        n = storage.nbytes()
        if n == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        self._section_peak = max(self._section_peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= n
