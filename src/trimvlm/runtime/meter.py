"""Cost meter: exact matmul FLOPs of what ran (per layer, per phase), KV bytes held, wall time, peak memory.

FLOPs count 2 per multiply-add of every matmul that executed (linear layers, attention scores and values,
LM head), on the shapes that actually ran, padding included; norms and element-wise ops are not counted (they
are < 1% of a decoder layer). The vision tower's FLOPs are measured by torch's FlopCounterMode (untimed, once
per input shape). Two lines: `flops` is the model's work per phase, `method_flops` the methods' own work per
phase (attention-probe rows, selection distances, merges, density windows, router: `kernels.flops`); the
total is their sum.
Peak memory is measured on tensors, never inferred from the process: on CUDA the allocator's peak over the
memory allocated at the start (`cuda_allocator_peak_over_start`); on CPU, with `track_tensors`, the peak of
live tensor bytes allocated during the run (`tensor_peak_over_start`, runtime/memory.py). The CPU tracker
slows every operation, so a timed CPU run reports no peak (kind `not_measured`): measure memory in a run of
its own (the eval harness does).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop

from trimvlm.runtime.lru import ByteLRU
from trimvlm.runtime.memory import TensorMemory


def _over(line: str, *phases: str) -> property:
    """The sum of the FLOPs line `line` over `phases` (every phase when none is named)."""
    return property(lambda self: sum(getattr(self, line).get(p, 0) for p in phases or getattr(self, line)))


@dataclass
class Costs:
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # phase -> the model's FLOPs
    method_flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # phase -> methods' FLOPs
    layer_flops: dict[str, dict[int, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    kv_bytes: int = 0  # attention KV held at the prefill/decode boundary (after any eviction)
    state_bytes: int = 0  # recurrent (Gated DeltaNet) states held
    kv_bytes_peak: int = 0  # the most attention KV held at any point (a prefill cache before its eviction counts)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    peak_memory_phase: dict[str, int] = field(default_factory=dict)  # phase -> its peak over its start
    layers_run: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    # the model's FLOPs (`flops`) or the methods' (`method_flops`) over phases: prefill includes the vision tower
    prefill_flops = _over("flops", "prefill", "vision")
    decode_flops = _over("flops", "decode")
    method_prefill_flops = _over("method_flops", "prefill", "vision")
    method_decode_flops = _over("method_flops", "decode")
    model_flops = _over("flops")  # every phase
    method_total_flops = _over("method_flops")

    @property
    def total_flops(self) -> int:
        """Model + method FLOPs."""
        return self.model_flops + self.method_total_flops

    def as_dict(self) -> dict:
        totals = ("prefill", "decode", "method_prefill", "method_decode", "model", "method_total", "total")
        return {
            "flops": dict(self.flops),
            "method_flops": dict(self.method_flops),
            **{f"{name}_flops": getattr(self, f"{name}_flops") for name in totals},
            "layer_flops": {k: dict(v) for k, v in self.layer_flops.items()},
            "kv_bytes": self.kv_bytes,
            "kv_bytes_peak": self.kv_bytes_peak,
            "state_bytes": self.state_bytes,
            "seconds": dict(self.seconds),
            "latency_s": sum(self.seconds.values()),
            # not measured (a CPU call without the tensor tracker): None beside the kind, never a 0
            "peak_memory_bytes": self.peak_memory_bytes if self.peak_memory_kind not in ("", "not_measured") else None,
            "peak_memory_kind": self.peak_memory_kind or "not_measured",
            "peak_memory_phase": dict(self.peak_memory_phase),
            "layers_run": dict(self.layers_run),
        }


class Meter:
    """`track_tensors`: measure peak memory on the tensors allocated between start_memory and stop_memory
    (`runtime.memory.TensorMemory`, any device) instead of the allocator / RSS; it slows every operation, so use
    it in runs that are not timed."""

    def __init__(self, device: torch.device | str = "cpu", track_tensors: bool = False):
        self.costs = Costs()
        self.device = torch.device(device)
        self._mem0 = 0
        self.track_tensors = track_tensors
        self._tracker = None

    def add_layer(self, phase: str, layer: int, flops: int) -> None:
        self.costs.flops[phase] += flops
        self.costs.layer_flops[phase][layer] += flops
        self.costs.layers_run[phase] += 1

    def add(self, phase: str, flops: int) -> None:
        self.costs.flops[phase] += flops

    def add_method(self, phase: str, flops: int) -> None:
        self.costs.method_flops[phase] += flops

    def kv(self, cache) -> None:
        """Record the cache at the prefill/decode boundary."""
        self.costs.kv_bytes = cache.attention_bytes()
        self.costs.state_bytes = cache.state_bytes()
        self.costs.kv_bytes_peak = max(self.costs.kv_bytes_peak, self.costs.kv_bytes)

    def kv_end(self, cache) -> None:
        """Record the cache after decoding (it only grows during decode, so this is its peak)."""
        self.costs.kv_bytes_peak = max(self.costs.kv_bytes_peak, cache.attention_bytes())

    @contextlib.contextmanager
    def timer(self, phase: str):
        """Time the block on `phase` (CUDA synchronized at both ends)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.costs.seconds[phase] += time.perf_counter() - t0

    def start_memory(self) -> None:
        if self.track_tensors:
            self._tracker = TensorMemory().__enter__()
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._mem0 = torch.cuda.memory_allocated(self.device)

    @contextlib.contextmanager
    def phase_memory(self, phase: str):
        """Context: with tensor tracking, record the peak of this phase over the live bytes at its start."""
        if self._tracker is None:
            yield
            return
        self._tracker.start_section()
        try:
            yield
        finally:
            self.costs.peak_memory_phase[phase] = self._tracker.end_section()

    def stop_memory(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.costs.peak_memory_bytes = self._tracker.peak
            self.costs.peak_memory_kind = "tensor_peak_over_start"
            self._tracker = None
            return
        if self.device.type == "cuda":
            self.costs.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device) - self._mem0
            self.costs.peak_memory_kind = "cuda_allocator_peak_over_start"
        else:
            self.costs.peak_memory_bytes = 0
            self.costs.peak_memory_kind = "not_measured"


def flop_counter():
    """torch's FlopCounterMode, also counting the CPU fused SDPA kernel (which torch's table lacks): 4·B·H·Q·K·d,
    the same rule torch uses for the CUDA SDPA kernels. Local to this counter; nothing global changes."""
    def cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop(query, key, value)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    return FlopCounterMode(display=False, custom_mapping=mapping)


class FlopsMemo(ByteLRU):
    """FLOPs of a call by its key (the shapes it depends on): counted by `flop_counter` on the call the first
    time the key is seen, then remembered. At most `keys` keys, least recently used dropped first."""

    def __init__(self, keys: int = 256):
        super().__init__(keys, "FLOPs memo")

    def run(self, key, call):
        """(call(), its FLOPs): counted on this very call when `key` is not remembered."""
        flops = self.get(key)
        if flops is not None:
            return call(), flops
        with flop_counter() as fc:
            out = call()
        self.put(key, fc.get_total_flops(), size=1)
        return out, fc.get_total_flops()
