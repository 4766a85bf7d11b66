"""trimvlm's batched `decide` vs transformers' `DecisionPipeline` on the same System One requests, in one process.

The requests: `--requests` (default 16) demo scenes as System One assets (base64 PNG), each asked
`--questions` (1-3) questions (noul, choice, score). Measured, in every round, in an order that rotates from
round to round (so drift on a shared machine hits all alike):
- `pipeline`: transformers' `DecisionPipeline`, one call per request (it runs one forward per prompt);
- `trimvlm-alone`: `vlm.decide(request)`, one call per request (one forward per request, its prompts batched);
- `trimvlm-batched`: `vlm.decide(requests)`, every prompt of every request in one forward;
- `trimvlm-batched+recipe`: the same with `--recipe` (default token reduction, keep 25% at layer 1).
Each time covers the whole call (decoding the images, rendering and tokenizing the prompts, the forward, the
answers). Reported: the median over `--rounds` per method, its ratio to the pipeline, the largest
probability difference to the pipeline's answers (empty recipe: <= 1e-5 expected) and the share of questions
answered alike.

    python benchmarks/decide_speed.py [--model demo] [--requests 16] [--rounds 5] [--json decide_speed.json] [--quick]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import trimvlm
from trimvlm.testing.decisions import DEMO_QUESTIONS as QUESTIONS


def requests(n: int, questions: int) -> list[dict]:
    from trimvlm.demo.task import make_scene, render

    out = []
    for seed in range(n):
        buf = io.BytesIO()
        render(make_scene(np.random.default_rng(2000 + seed))).save(buf, format="PNG")
        data = base64.b64encode(buf.getvalue()).decode()
        out.append({
            "state": {"photo": "<img>"},
            "questions": dict(list(QUESTIONS.items())[:questions]),
            "assets": {"<img>": {"type": "image", "format": "png", "data_base64": data}},
        })  # fmt: skip
    return out


def pipeline(vlm):
    """transformers' DecisionPipeline over the same weights and decision config (a fresh processor; for a
    decision model, the model transformers itself loads from the folder)."""
    from transformers import JevForDecision
    from transformers.pipelines import DecisionPipeline

    from trimvlm.decision.config import resolve_config

    proc = vlm.adapter.decision_processor()
    images = getattr(proc, "image_processor", None) is not None
    if vlm.adapter.decision_head is not None:
        model, cfg = JevForDecision.from_pretrained(vlm.adapter.folder).eval(), None
    else:
        model, cfg = vlm.adapter.model, resolve_config(vlm)
    return DecisionPipeline(
        model=model, tokenizer=getattr(proc, "tokenizer", proc), processor=proc if images else None,
        decision_config=cfg,
    )  # fmt: skip


def max_diff(a: list[dict], b: list[dict]) -> float:
    """The largest difference of any probability (`noul`, `confidence`, `probabilities`) between two lists of
    answers."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for name in x:
            for k, v in x[name].items():
                if k in ("noul", "confidence"):
                    worst = max(worst, abs(v - y[name][k]))
                elif k == "probabilities":
                    worst = max(worst, *(abs(v[o] - y[name][k][o]) for o in v))
    return worst


def agreement(a: list[dict], b: list[dict]) -> float:
    """The fraction of questions answered alike: the same choice, the same most likely score level, P(true) on
    the same side of 0.5."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        for name, u in x.items():
            v = y[name]
            if u["type"] == "noul":
                same += (u["noul"] > 0.5) == (v["noul"] > 0.5)
            elif u["type"] == "choice":
                same += u["choice"] == v["choice"]
            else:
                same += max(u["probabilities"], key=u["probabilities"].get) == max(
                    v["probabilities"], key=v["probabilities"].get
                )
            total += 1
    return same / total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--questions", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--recipe", default="tokens=density:keep=0.25:layer=1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: 2 requests x 1 question, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.questions, args.rounds = 2, 1, 1
    torch.set_num_threads(args.threads)
    console = Console(width=160)

    vlm = trimvlm.load(args.model, device=args.device)
    pipe = pipeline(vlm)
    reqs = requests(args.requests, args.questions)
    methods = {
        "pipeline": lambda: [pipe(r) for r in reqs],
        "trimvlm-alone": lambda: [vlm.decide(r) for r in reqs],
        "trimvlm-batched": lambda: vlm.decide(reqs),
        "trimvlm-batched+recipe": lambda: vlm.decide(reqs, recipe=args.recipe),
    }
    with torch.no_grad():
        answers = {name: fn() for name, fn in methods.items()}  # warm-up, and the answers compared
        times = {name: [] for name in methods}
        names = list(methods)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                methods[name]()
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["pipeline"])
    table = Table(
        title=f"{args.model}: {args.requests} requests x {args.questions} questions, {args.rounds} rounds"
    )
    for col in ("method", "median s", "per request ms", "speedup vs pipeline", "max |d prob| vs pipeline",
                "same answers"):  # fmt: skip
        table.add_column(col)
    rows = []
    for name in methods:
        med = statistics.median(times[name])
        diff = max_diff(answers[name], answers["pipeline"])
        agree = agreement(answers[name], answers["pipeline"])
        rows.append({"method": name, "median_s": med, "times_s": times[name], "per_request_ms": 1e3 * med / len(reqs),
                     "speedup": base / med, "max_prob_diff": diff, "same_answers": agree})  # fmt: skip
        table.add_row(name, f"{med:.3f}", f"{1e3 * med / len(reqs):.1f}", f"{base / med:.2f}x", f"{diff:.2e}",
                      f"{100 * agree:.0f}%")  # fmt: skip
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
        console.print(f"[dim]wrote {args.json}[/]")


if __name__ == "__main__":
    main()
