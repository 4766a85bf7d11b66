"""The item protocol of the one harness (trimvlm.evals.run): what a task's records are, and how a batch of them
runs with one recipe. A new item kind (decisions, say) is one class with these members:

    id, kind, probe, metric          the item's id, the group it is reported under, its probe kind (batches never
                                     mix probes or kinds) and the name of what scores it
    batch_key(task)                  items of one batch share it (the generation cap is part of it)
    run(vlm, items, recipe, task, opts, track_memory) -> (outputs, costs, executor)   classmethod: one call,
                                     timed by the caller; `outputs` one per item, `costs` the call's `Costs`,
                                     `executor` what ran it ("" when there is no choice)
    prepare(vlm, items, task, opts) -> opts     classmethod: checks before any item runs (opts resolved)
    untimed(vlm, items, task, opts)  classmethod: once per batch, before its recipes run, outside every timing
    score(output) -> float;  canonical(output) -> what the agreement with the baseline compares
    summary(items, outputs) -> dict  classmethod: a group's extras (POPE's F1, abstentions)
    as_json() -> dict                the item in the results JSON

`Record` (trimvlm.evals.tasks.base) is the generation item, `CandidateItem` below the candidate item.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class RunOptions:
    seed: int = 0
    readout: str = "auto"  # candidate items: auto | loglik | head
    executor: str = "auto"  # candidate items: the executor of vlm.score


@dataclass
class CandidateItem:
    """One question scored over its fixed candidates (FastJEV's protocol): the chosen candidate is the argmax of
    the decision logits (head readout: an abstention, -1, counts as wrong)."""

    id: str
    image: Any
    question: str
    candidates: list[str]
    answer: int  # index of the right candidate
    kind: str
    probe: str = "candidates"
    metric: str = "choice"

    def batch_key(self, task) -> tuple:
        return (self.probe, self.kind)

    def request(self):
        from trimvlm.scoring.request import ScoreRequest

        return ScoreRequest(self.image, self.question, list(self.candidates))

    @classmethod
    def run(cls, vlm, items, recipe, task, opts: RunOptions, track_memory: bool = False):
        kw = {"track_memory": True} if track_memory else {}
        res = vlm.score([it.request() for it in items], readout=opts.readout, executor=opts.executor,
                        recipe=recipe, **kw)  # fmt: skip
        return [out.chosen for out in res.results], res.costs, res.executor

    @classmethod
    def prepare(cls, vlm, items, task, opts: RunOptions) -> RunOptions:
        from trimvlm.scoring.calibrate import resolve_readout
        from trimvlm.scoring.engine import check_choice

        opts = replace(opts, readout=resolve_readout(vlm, opts.readout))
        check_choice(opts.executor, opts.readout, vlm.head)
        return opts

    @classmethod
    def untimed(cls, vlm, items, task, opts: RunOptions) -> None:
        """The first call on a batch pays one-time costs (the vision FLOP count of new shapes, kernel set-up):
        one untimed baseline call takes them."""
        cls.run(vlm, items, None, task, opts)

    def score(self, output) -> float:
        return float(output == self.answer)

    def canonical(self, output):
        return output

    @classmethod
    def summary(cls, items, outputs) -> dict:
        return {"abstained": sum(o < 0 for o in outputs)}

    def as_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "probe": self.probe, "metric": self.metric,
                "question": self.question, "candidates": self.candidates, "answer": self.answer}  # fmt: skip
