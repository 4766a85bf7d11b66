"""A scoring request and its answer, as data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trimvlm.errors import InputError
from trimvlm.runtime.meter import Costs

READOUTS = ("loglik", "head")


@dataclass
class ScoreRequest:
    """Images (one image or path, a list of them, or None), a question, and the candidates to score.
    `binary`: one candidate statement, answered as P(true) = sigmoid(logit) by the head readout."""

    images: Any
    question: str
    candidates: list[str]
    binary: bool = False

    def check(self, index: int) -> None:
        if not isinstance(self.question, str) or not self.question.strip():
            raise InputError(f"request {index}: empty question; give a non-empty question")
        if isinstance(self.candidates, str) or not isinstance(self.candidates, list | tuple):
            raise InputError(
                f"request {index}: candidates must be a list of strings, got {self.candidates!r}"
            )
        if not self.candidates:
            raise InputError(f"request {index}: no candidates; give at least one candidate to score")
        if self.binary and len(self.candidates) != 1:
            raise InputError(f"request {index}: a binary request has exactly one candidate statement")


@dataclass
class CandidateScore:
    text: str
    logit: float
    prob: float
    loglik_sum: float
    loglik_mean: float
    n_tokens: int
    is_greedy: bool
    answer_loglik: float = 0.0  # the candidate's own tokens only, its close marker left out (lmms-eval's loglik)
    answer_greedy: bool = False  # every one of those tokens the argmax


@dataclass
class ScoreResult:
    question: str
    candidates: list[CandidateScore]
    chosen: int  # index of the chosen candidate; -1 when the head abstains
    abstain_logit: float | None = None
    abstain_prob: float | None = None
    binary_prob: float | None = None  # P(true) of a binary request (head readout)

    @property
    def chosen_text(self) -> str | None:
        return None if self.chosen < 0 else self.candidates[self.chosen].text

    @property
    def logits(self) -> list[float]:
        return [c.logit for c in self.candidates]

    @property
    def probs(self) -> list[float]:
        return [c.prob for c in self.candidates]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["chosen_text"] = self.chosen_text
        return d


@dataclass
class ScoreBatch:
    results: list[ScoreResult]
    costs: Costs
    readout: str
    executor: str  # the executor that ran (what `auto` chose)
    recipe: str
    # candidate tokens: logical (every candidate's own), unique (trie nodes), executed (what the executor ran:
    # `tree` may run a short shared run again inside each child's row when that is cheaper)
    tokens: dict = field(default_factory=dict)

    def __getitem__(self, i: int) -> ScoreResult:
        return self.results[i]

    def __len__(self) -> int:
        return len(self.results)

    def as_dict(self) -> dict:
        return {
            "readout": self.readout,
            "executor": self.executor,
            "recipe": self.recipe,
            "tokens": self.tokens,
            "results": [r.as_dict() for r in self.results],
            "costs": self.costs.as_dict(),
        }


def as_requests(images, question, candidates, binary=False) -> list[ScoreRequest]:
    """One request (question a string) or a batch (question a list of strings, images and candidates lists
    of the same length)."""
    if isinstance(images, ScoreRequest):
        return [images]
    if isinstance(images, list | tuple) and images and all(isinstance(r, ScoreRequest) for r in images):
        return list(images)
    if isinstance(question, str):
        return [ScoreRequest(images, question, candidates, binary)]
    if not isinstance(question, list | tuple) or not question:
        raise InputError("question must be a string or a non-empty list of strings")
    n = len(question)
    if not isinstance(candidates, list | tuple) or len(candidates) != n:
        raise InputError(f"a batch of {n} questions needs a list of {n} candidate lists")
    if not isinstance(images, list | tuple) or len(images) != n:
        raise InputError(f"a batch of {n} questions needs a list of {n} image entries (None for none)")
    flags = binary if isinstance(binary, list | tuple) else [binary] * n
    return [ScoreRequest(images[i], question[i], candidates[i], bool(flags[i])) for i in range(n)]
