"""The item protocol of the one harness (trimvlm.evals.run): what a task's records are, and how a batch of them
runs with one recipe. A new item kind (decisions, say) is one class with these members:

    id, kind, probe, metric          the item's id, the group it is reported under, its probe kind (batches never
                                     mix probes or kinds) and the name of what scores it
    batch_key(task)                  items of one batch share it (the generation cap is part of it)
    run(vlm, items, recipe, task, opts, track_memory) -> ItemsRun(outputs, costs, executor)   classmethod: one call,
                                     timed by the caller; `outputs` one per item, `costs` the call's `Costs`,
                                     `executor` what ran it ("" when there is no choice)
    prepare(vlm, items, task, opts) -> opts     classmethod: checks before any item runs (opts resolved)
    untimed(vlm, items, task, opts)  classmethod: once per batch, before its recipes run, outside every timing
    score(output) -> float;  canonical(output) -> what the agreement with the baseline compares
    summary(items, outputs) -> dict  classmethod: a group's extras (POPE's F1, abstentions)
    as_json() -> dict                the item in the results JSON

`Record` (trimvlm.evals.tasks.base) is the generation item, `CandidateItem` below the candidate item and
`DecisionItem` the System One request (`vlm.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple


class ItemsRun(NamedTuple):
    """What one `run` of a batch of items gives back."""

    outputs: list  # one per item
    costs: Any  # the call's `Costs`
    executor: str = ""  # what ran it ("" when there is no choice)


@dataclass(frozen=True)
class RunOptions:
    seed: int = 0
    readout: str = "auto"  # candidate items: auto | loglik | head
    executor: str = "auto"  # candidate items: the executor of vlm.score


class BatchedByKind:
    """What the candidate and decision items share: batches of one (probe, kind); no checks before a run; one
    untimed baseline call per batch takes the one-time costs (the vision FLOP count of new shapes, kernel
    set-up) before its recipes run."""

    def batch_key(self, task) -> tuple:
        return (self.probe, self.kind)

    @classmethod
    def prepare(cls, vlm, items, task, opts: RunOptions) -> RunOptions:
        return opts

    @classmethod
    def untimed(cls, vlm, items, task, opts: RunOptions) -> None:
        cls.run(vlm, items, None, task, opts)


@dataclass
class CandidateItem(BatchedByKind):
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

    def request(self):
        from trimvlm.scoring.request import ScoreRequest

        return ScoreRequest(self.image, self.question, list(self.candidates))

    @classmethod
    def run(cls, vlm, items, recipe, task, opts: RunOptions, track_memory: bool = False):
        kw = {"track_memory": True} if track_memory else {}
        res = vlm.score([it.request() for it in items], readout=opts.readout, executor=opts.executor,
                        recipe=recipe, **kw)  # fmt: skip
        return ItemsRun([out.chosen for out in res.results], res.costs, res.executor)

    @classmethod
    def prepare(cls, vlm, items, task, opts: RunOptions) -> RunOptions:
        from trimvlm.scoring.calibrate import resolve_readout
        from trimvlm.scoring.engine import check_choice

        opts = replace(opts, readout=resolve_readout(vlm, opts.readout))
        check_choice(opts.executor, opts.readout, vlm.head)
        return opts

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


@dataclass
class DecisionItem(BatchedByKind):
    """One System One request (`vlm.decide`: a state, its assets, several typed questions) with the expected
    answer of each question: a noul question's `yes` / `no` (yes: the probability of true is above one half),
    a choice question's option name, a score question's most probable criterion. Its output is the answer
    picked per question; its score the fraction of its questions answered right."""

    id: str
    request: dict  # {"state", "questions", "assets"}
    answers: dict[str, str]  # question name -> expected answer
    kind: str = "decision"
    probe: str = "decision"
    metric: str = "decision"

    @classmethod
    def run(cls, vlm, items, recipe, task, opts: RunOptions, track_memory: bool = False):
        res = vlm.decide([it.request for it in items], recipe=recipe, return_costs=True, track_memory=track_memory)
        return ItemsRun([{q: picked(a) for q, a in out.items()} for out in res.answers], res.costs)

    def score(self, output) -> float:
        return sum(output.get(q) == a for q, a in self.answers.items()) / len(self.answers)

    def canonical(self, output):
        return tuple(sorted(output.items()))

    @classmethod
    def summary(cls, items, outputs) -> dict:
        """Per question name, the fraction answered right."""
        right: dict[str, list[bool]] = {}
        for it, out in zip(items, outputs, strict=True):
            for q, a in it.answers.items():
                right.setdefault(q, []).append(out.get(q) == a)
        return {"by_question": {q: sum(v) / len(v) for q, v in right.items()}}

    def as_json(self) -> dict:
        questions = self.request["questions"]
        return {"id": self.id, "kind": self.kind, "probe": self.probe, "metric": self.metric,
                "state": self.request["state"], "questions": questions, "answers": self.answers}  # fmt: skip


def picked(answer: dict) -> str:
    """The answer a System One answer dict picks: noul yes / no, a choice's option, a score's likeliest
    criterion."""
    if answer["type"] == "noul":
        return "yes" if answer["noul"] > 0.5 else "no"
    if answer["type"] == "choice":
        return answer["choice"]
    return max(answer["probabilities"], key=answer["probabilities"].get)
