"""System One questions the demo models answer, and an answer comparison (tests and decision benchmarks)."""

from __future__ import annotations

# one question of each type, in the demo task's words
DEMO_QUESTIONS = {
    "circle": {"type": "noul", "instructions": "is there a blue circle ?"},
    "which": {"type": "choice", "instructions": "which is present ?",
              "criteria": {"rs": "red square", "bc": "blue circle", "gt": "green triangle", "wc": None}},
    "yellow": {"type": "score", "instructions": "how many yellow ?", "criteria": ["0", "1", "2", "3", "4"]},
}  # fmt: skip


def assert_same_answers(a: dict, b: dict, tol: float = 1e-5) -> None:
    """Two answer dicts: same questions, types, keys and chosen options; numbers within `tol`."""
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.keys() == y.keys(), name
        for k in x:
            if isinstance(x[k], float):
                assert abs(x[k] - y[k]) <= tol, (name, k, x[k], y[k])
            elif k == "probabilities":
                assert x[k].keys() == y[k].keys()
                for o in x[k]:
                    assert abs(x[k][o] - y[k][o]) <= tol, (name, o, x[k][o], y[k][o])
            else:
                assert x[k] == y[k], (name, k)
