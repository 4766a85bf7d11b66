"""Router training data at scale: a work folder the measured inputs are written to as they are measured.

`trimvlm train-router --work DIR` measures each training input's layouts (one layout trie per input,
training/layout_trie.py) and writes them under DIR before the next input starts; run the same command again
after an interruption and it reads what DIR holds and measures only the inputs after it (each input's random
draws are seeded by (seed, its index), so the result is that of one uninterrupted run). More inputs (a larger
--n) extend the collection; `--epochs 0` collects without training.

- DIR/settings.json: how the layouts are drawn; a run with other settings is refused;
- DIR/inputs/NNNNNN.pt: input NNNNNN's `Measured` layouts (a temporary file renamed: never half written);
- DIR/log.jsonl: one line per input measured: its index, the layouts run, the decoder-layer runs of one row
  the trie made and those the layouts would make apart, and the seconds it took.

Sampling (`near`, v2): rather than every (keep, layer set) cell for every token set, the noise-perturbed
token sets run only the cells whose predicted total-FLOP ratio is within `near` of one of `budgets` (at most
`cells` of them per input, drawn at random); the plain token set still runs every cell, since the budget
calibration interpolates its KL over the whole table. Layouts not run carry a NaN cost and form no pair.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trimvlm.errors import InputError


@dataclass
class Measured:
    """One input's measured layouts: the router's inputs, each layout's chosen elements, and its KL over the
    [keeps x token sets x layer sets] grid (NaN: a layout not run)."""

    feats: tuple  # (vis, vis_mask, txt, txt_mask), batch of one
    chosen: torch.Tensor  # [M, Nv + N] bool
    cost: torch.Tensor  # [M] float64
    n_keep: int
    n_tok: int
    sizes: list  # per layer set, how many layers it skips


@dataclass
class Collect:
    """How every input's layouts are drawn (`train_router`'s settings)."""

    cand: list
    keeps: list
    layer: int
    seed: int
    sigmas: list
    seeds: int
    answer_tokens: int
    layers_skip: int
    lays: list | None  # v2: every layer set; None: v1's sampled ones
    near: float | None = None  # v2 sampling: the window around the budgets
    budgets: list | None = None
    cells: int | None = None  # at most this many cells near the budgets per input (None: all of them)
    cost: list | None = field(default=None, repr=False)  # [keep][layer set] predicted total-FLOP ratios

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "cost"}

    def sampled(self, gen: torch.Generator) -> set | None:
        """The (keep, layer set) cells the noise-perturbed token sets run on one input (None: every cell)."""
        if self.near is None:
            return None
        near = [(k, j) for k, row in enumerate(self.cost) for j, c in enumerate(row)
                if any(abs(c - b) <= self.near for b in self.budgets)]  # fmt: skip
        if self.cells is not None and len(near) > self.cells:
            near = [near[i] for i in torch.randperm(len(near), generator=gen)[: self.cells].tolist()]
        return set(near)


def check_sampling(v2: bool, near, budgets, cells) -> None:
    """Sampling near the budgets needs router v2 (its cost table), budgets and a window."""
    if near is None:
        if cells is not None:
            raise InputError("cells applies with near= (layouts sampled near the budgets)")
        return
    if not v2:
        raise InputError("near= samples router v2 layouts: give keeps (train-router --keeps)")
    if not budgets or not near > 0 or (cells is not None and cells < 1):
        raise InputError(f"near= needs budgets, a window > 0 and cells >= 1 when given; got budgets={budgets!r}, "
                         f"near={near!r}, cells={cells!r}")  # fmt: skip


def prepare_work(work, fingerprint: str, collect: Collect) -> Path | None:
    """The work folder, its settings written (or checked against those it holds)."""
    if work is None:
        return None
    work = Path(work)
    (work / "inputs").mkdir(parents=True, exist_ok=True)
    path = work / "settings.json"
    mine = json.loads(json.dumps({"fingerprint": fingerprint} | collect.settings()))
    if path.exists():
        held = json.loads(path.read_text())
        if held != mine:
            diff = sorted(k for k in held.keys() | mine.keys() if held.get(k) != mine.get(k))
            raise InputError(f"{work} holds inputs measured with other settings ({', '.join(diff)}): give another "
                             "--work folder, or the same settings")  # fmt: skip
    else:
        path.write_text(json.dumps(mine, indent=2) + "\n")
    return work


def stored(work: Path | None, index: int, measure) -> Measured:
    """Input `index`'s measured layouts: read from `work` when it holds them, else `measure()` ((Measured,
    TrieOutput)) and, with a work folder, written there and logged."""
    path = None if work is None else work / "inputs" / f"{index:06d}.pt"
    if path is not None and path.exists():
        got = torch.load(path)
        return Measured(**(got | {"feats": tuple(got["feats"])}))
    start = time.perf_counter()
    m, trie = measure()
    if path is None:
        return m
    tmp = path.with_suffix(".tmp")
    torch.save(asdict(m), tmp)
    tmp.replace(path)
    line = {"input": index, "layouts": int((~m.cost.isnan()).sum()), "trie_layers": trie.node_layers,
            "apart_layers": trie.layout_layers, "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip
    with open(work / "log.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return m
