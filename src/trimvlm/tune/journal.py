"""Every evaluation `trimvlm tune` runs, through the one harness, remembered in `OUT/journal.jsonl`.

An evaluation is (recipe, items): one `evals.run.run_eval` call runs every recipe asked for on the same items,
interleaved, with the baseline first; each recipe's row (accuracy, mismatch, retention, cost sums and ratios to
that call's baseline) is appended to the journal as soon as the call ends. A killed run started again finds its
finished evaluations there (keyed by the model's fingerprint, the task, the items, the batch size and the
recipe) and runs only the rest, so it continues where it stopped and ends with the same frontier.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from trimvlm.recipe import parse_recipe

KEEP = ("accuracy", "mismatch_pct", "agreement", "retention", "n")


def local_evaluator(vlm):
    """`evaluate(task, recipes, **kw)` as `run_eval(vlm, task, recipes, **kw)` in this process."""

    def evaluate(task, recipes, **kw):
        from trimvlm.evals.run import run_eval

        return run_eval(vlm, task, recipes, **kw)

    return evaluate


def spec_of(recipe) -> str:
    """A recipe's identity: its axes' specs, not its name."""
    return parse_recipe({k: v for k, v in dict(recipe).items() if k != "name"}).label()


class Journal:
    def __init__(self, vlm, task, out: str | Path | None, *, batch_size: int, fingerprint: str, on_run=None,
                 evaluate=None):  # fmt: skip
        """`evaluate(task, recipes, **run_eval_kw)`: where the evaluations run (default: `run_eval` on `vlm`
        in this process; `trimvlm tune --ray`: a `RayEvaluator`)."""
        self.vlm, self.task, self.batch_size, self.on_run = vlm, task, batch_size, on_run
        self.evaluate = evaluate if evaluate is not None else local_evaluator(vlm)
        self.path = None if out is None else Path(out) / "journal.jsonl"
        self.base = hashlib.blake2b(f"{fingerprint}|{task.name}|{batch_size}|{task.max_new_tokens}".encode(),
                                    digest_size=8).hexdigest()  # fmt: skip
        self.rows: dict[str, dict] = {}
        self.calls = 0  # run_eval calls this process made
        self.ran: set[str] = set()  # recipe specs evaluated (from the journal or now)
        self.touched: set[str] = set()  # item ids any evaluation read
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.rows[entry["key"]] = entry["row"]

    def _key(self, spec: str, items_key: str) -> str:
        return f"{self.base}|{items_key}|{spec}"

    def items_key(self, idx: list[int]) -> str:
        ids = "|".join(str(self.task.records[i].id) for i in idx)
        return hashlib.blake2b(ids.encode(), digest_size=8).hexdigest()

    def run(self, recipes: list[dict], idx: list[int]) -> dict[str, dict]:
        """spec -> row of every recipe (and "baseline") on the items `idx`; only the missing ones are run."""
        ik = self.items_key(idx)
        specs = {spec_of(r): r for r in recipes}
        specs.setdefault("baseline", {"name": "baseline"})
        missing = [s for s in specs if self._key(s, ik) not in self.rows]
        if missing:
            task = replace(self.task, records=[self.task.records[i] for i in idx])
            todo = [{**specs[s], "name": s} for s in missing if s != "baseline"]
            res = self.evaluate(task, todo, batch_size=self.batch_size, warmup=False, memory="off", progress=False)
            self.calls += 1
            self.touched |= {str(r.id) for r in task.records}
            lines = []
            for s in missing:
                row = res.row(s)
                kept = {k: row[k] for k in KEEP} | {"ratio": row["ratio"], "sum": row["costs"]["sum"]}
                self.rows[self._key(s, ik)] = kept
                lines.append(json.dumps({"key": self._key(s, ik), "row": kept}))
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write("".join(line + "\n" for line in lines))
            if self.on_run is not None:
                self.on_run(len(todo))
        self.ran |= set(specs) - {"baseline"}
        return {s: self.rows[self._key(s, ik)] for s in specs}
