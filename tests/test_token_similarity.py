"""benchmarks/token_similarity.py: neighbour similarity on hand-made token grids with known answers."""

import importlib.util
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location(
    "token_similarity", Path(__file__).parents[1] / "benchmarks" / "token_similarity.py"
)
ts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ts)


def test_known_grids():
    g = torch.Generator().manual_seed(0)
    flat = ts.neighbour_stats(torch.ones(12, 4), 3, 4, g)  # every token alike: cos 1 everywhere
    assert all(abs(c - 1) < 1e-6 for c in flat["neighbour"] + flat["random"] + flat["best"])
    assert len(flat["neighbour"]) == 3 * 3 + 2 * 4  # right pairs + down pairs
    e = torch.eye(2)
    checker = torch.stack([e[(r + c) % 2] for r in range(3) for c in range(4)])  # neighbours orthogonal
    stats = ts.neighbour_stats(checker, 3, 4, g)
    assert all(abs(c) < 1e-6 for c in stats["neighbour"] + stats["best"])
    assert set(round(c) for c in stats["random"]) <= {0, 1}


def test_quick_run_on_the_demo(capsys):
    ts.main(["--quick"])
    out = capsys.readouterr().out
    assert '"images": 4' in out and '"visual_tokens_median": 64' in out
