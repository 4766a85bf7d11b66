"""How redundant an image's visual tokens are where the pruners act: the cosine similarity of each visual token
to its right and lower neighbours at the decoder's input (layer 0, after the projector), against random
pairs of tokens of the same image. Real VLM inputs are highly redundant there (neighbouring patches of sky,
wall or page); the grid demo (one object per token) is not. Pooling and downsampling only work where
neighbours are alike, so this explains where they fail.

    python benchmarks/token_similarity.py --model demo --task demo --json docs/results/token-similarity-demo.json
    python benchmarks/token_similarity.py --model demo-scenes --task scenes --json docs/results/token-similarity-scenes.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import trimvlm
from trimvlm.evals.tasks import get_task

THRESHOLD = 0.9


def neighbour_stats(hidden: torch.Tensor, h: int, w: int, generator: torch.Generator) -> dict:
    """hidden [h * w, d] in raster order -> neighbour and random-pair cosine similarities."""
    x = torch.nn.functional.normalize(hidden.float().reshape(h, w, -1), dim=-1)
    right = (x[:, :-1] * x[:, 1:]).sum(-1).flatten()
    down = (x[:-1] * x[1:]).sum(-1).flatten()
    near = torch.cat([right, down])
    flat = x.reshape(h * w, -1)
    a, b = torch.randint(0, h * w, (2, near.numel()), generator=generator)
    rand = (flat[a] * flat[b]).sum(-1)
    best = torch.full((h, w), -1.0)  # each token's most similar 4-neighbour
    best[:, :-1] = torch.maximum(best[:, :-1], right.reshape(h, w - 1))
    best[:, 1:] = torch.maximum(best[:, 1:], right.reshape(h, w - 1))
    best[:-1] = torch.maximum(best[:-1], down.reshape(h - 1, w))
    best[1:] = torch.maximum(best[1:], down.reshape(h - 1, w))
    return {"neighbour": near.tolist(), "random": rand.tolist(), "best": best.flatten().tolist()}


def measure(model: str, task: str, n_images: int, seed: int = 0) -> dict:
    vlm = trimvlm.load(model)
    records = get_task(task, limit=None, seed=seed, split="val").records
    seen, images = set(), []
    for r in records:  # one question per image
        key = id(r.images[0])
        if key not in seen:
            seen.add(key)
            images.append(r)
        if len(images) == n_images:
            break
    g = torch.Generator().manual_seed(seed)
    pooled = {"neighbour": [], "random": [], "best": []}
    tokens = []
    for r in images:
        prep = vlm.adapter.prepare([list(r.images)], [r.prompt_text()])
        with torch.no_grad():
            seq = vlm.adapter.embed(prep)
        h, w = seq.grids[0][0]
        vis = seq.hidden[0][seq.visual[0]]
        stats = neighbour_stats(vis[: h * w], h, w, g)
        for k in pooled:
            pooled[k] += stats[k]
        tokens.append(h * w)
    med = statistics.median
    return {
        "model": model, "task": task, "images": len(images), "visual_tokens_median": med(tokens),
        "neighbour_cos_median": med(pooled["neighbour"]), "random_cos_median": med(pooled["random"]),
        "neighbour_cos_mean": statistics.fmean(pooled["neighbour"]),
        "random_cos_mean": statistics.fmean(pooled["random"]),
        "share_with_a_neighbour_above": {"threshold": THRESHOLD,
                                         "share": sum(b > THRESHOLD for b in pooled["best"]) / len(pooled["best"])},
    }  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--task", default="demo")
    ap.add_argument("--images", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="4 images")
    a = ap.parse_args(argv)
    res = measure(a.model, a.task, 4 if a.quick else a.images)
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
