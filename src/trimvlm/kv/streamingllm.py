"""StreamingLLM on the visual span: keep the first `sinks` visual entries (attention sinks) and the most recent
ones. docs/references.md#streamingllm; one shot at the prefill/decode boundary, original positions kept."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.kv.base import KVPolicy, LayerView, order_in_span
from trimvlm.options import option, require_int
from trimvlm.protocol import register


@register("kv", "streamingllm")
@dataclass
class StreamingLLMKV(KVPolicy):
    """Options: `sinks` (first visual entries always kept first, default 4), `keep`."""

    sinks: int = option(4, require_int, minimum=0)

    def scores(self, view: LayerView):
        from_start, _ = order_in_span(view.candidates)
        k = view.candidates.shape[1]
        recency = from_start.float()  # later entry = more recent = higher
        sink = from_start < self.sinks
        return recency.masked_fill(sink, 0.0) + sink.float() * (2 * k - from_start.float())
