"""What one request of a decision batch cost, for a server's `usage`.

The batch is measured as one run (`runtime.meter.Costs`); a request's share is, line by line:
- vision FLOPs: its share of the batch's one vision encode (counted by the runner on that encode), weighted by
  the image tokens encoded for it (the vision tower is never run a second time to count a request alone);
- decoder-layer FLOPs, method FLOPs, KV and recurrent-state bytes: its rows' share of the padded batch (every
  row of a padded batch runs the same matmuls and holds the same cache; padding is counted, as the meter counts
  what ran). With a per-sample layer plan (the router) rows differ and the share is an average;
- readout FLOPs: its own marks' rows;
- latency: its own preprocessing plus the whole batch's forward (a request waits for the batch).
The shares of a batch sum to its totals. With the caches (runtime/prefix_cache.py, runtime/vision_cache.py) what
a request did not run costs it nothing: a reused prefix has no prefill, vision or method FLOPs (its tails' branch
FLOPs remain), an image found in the vision cache no vision FLOPs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import islice


@dataclass
class RequestCosts:
    prompts: int  # prompts its questions were rendered into
    questions: int
    input_tokens: int  # real tokens of its prompts (transformers serve's usage.input_tokens)
    images: int  # images in its prompts (an asset used by several prompts counts once per prompt)
    vision_flops: int
    layer_flops: int
    readout_flops: int
    method_flops: int
    kv_bytes: int  # its rows of the KV the layers held at the end of the forward (nothing is decoded)
    state_bytes: int  # its rows of the recurrent (Gated DeltaNet) states
    preprocess_s: float
    forward_s: float  # the batch's forward (shared)
    batch_requests: int
    batch_prompts: int
    prefix_reused: bool = False  # its prefix KV came from the prefix cache (or from a request of its batch)
    prefix_tokens_reused: int = 0  # the tokens of that prefix (not prefilled for it)
    vision_cache_hits: int = 0  # its images whose features came from the vision cache (not encoded for it)

    @property
    def model_flops(self) -> int:
        return self.vision_flops + self.layer_flops + self.readout_flops

    @property
    def total_flops(self) -> int:
        return self.model_flops + self.method_flops

    @property
    def latency_s(self) -> float:
        return self.preprocess_s + self.forward_s

    def as_dict(self) -> dict:
        return asdict(self) | {
            "model_flops": self.model_flops,
            "total_flops": self.total_flops,
            "latency_s": self.latency_s,
        }

    def usage(self) -> dict:
        """transformers serve's `usage` (input_tokens, output_tokens = 0) with the cost fields added."""
        return {"input_tokens": self.input_tokens, "output_tokens": 0} | self.as_dict()


def split(total: int, weights: list[int]) -> list[int]:
    """Integer shares of `total` proportional to `weights`, summing to `total` (largest remainders)."""
    w = sum(weights)
    if w == 0:
        return [0] * len(weights)
    base = [total * x // w for x in weights]
    rest = total - sum(base)
    order = sorted(range(len(weights)), key=lambda i: -((total * weights[i]) % w))
    for i in order[:rest]:
        base[i] += 1
    return base


def grouped(items, sizes: list[int]) -> list[list]:
    """`items` cut into consecutive groups of `sizes` (per request its prompts', questions' entries)."""
    it = iter(items)
    return [list(islice(it, n)) for n in sizes]


def request_costs(
    prepared_requests, fwd, costs, vision: list[int], readout: list[int], vision_hits: list[int]
) -> list[RequestCosts]:
    """Per request its share of the batch (`fwd`: decision.forward.Forward; `costs`: the batch's Costs;
    `vision_hits`: its images found in the vision cache)."""
    rows = [len(r.prompts) for r in prepared_requests]
    n_images = fwd.n_images
    if fwd.kv_rows is not None:  # a shared-prefix forward: one prefix row per request holds all its images
        images = [n_images[r] * n for r, n in enumerate(rows)]
    else:
        images = [sum(g) for g in grouped(n_images, rows)]
    reuse = fwd.reuse
    if reuse is None:
        layers = split(fwd.layer_flops, rows)
        method = split(costs.method_total_flops, rows)
    else:  # the prefill ran for the requests it computed (one prefix row each), the tails for every prompt
        ran = [int(i in reuse.computed) for i in range(len(rows))]
        tails = split(fwd.layer_flops - reuse.prefill_flops, rows)
        layers = [a + b for a, b in zip(split(reuse.prefill_flops, ran), tails, strict=True)]
        method = split(costs.method_total_flops, ran if any(ran) else rows)
    kv_rows = fwd.kv_rows or rows  # a shared-prefix forward holds one prefix row per request
    kv = split(fwd.cache.attention_bytes(), kv_rows)
    state = split(fwd.cache.state_bytes(), kv_rows)
    forward_s = sum(costs.seconds.values())
    return [
        RequestCosts(
            prompts=rows[i],
            questions=r.questions,
            input_tokens=r.input_tokens,
            images=images[i],
            vision_flops=vision[i],
            layer_flops=layers[i],
            readout_flops=readout[i],
            method_flops=method[i],
            kv_bytes=kv[i],
            state_bytes=state[i],
            preprocess_s=r.seconds,
            forward_s=forward_s,
            batch_requests=len(prepared_requests),
            batch_prompts=sum(rows),
            prefix_reused=bool(reuse is not None and reuse.hits[i]),
            prefix_tokens_reused=reuse.tokens[i] if reuse is not None and reuse.hits[i] else 0,
            vision_cache_hits=vision_hits[i],
        )  # fmt: skip
        for i, r in enumerate(prepared_requests)
    ]
