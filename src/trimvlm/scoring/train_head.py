"""`trimvlm train-head`: train the decision head of a checkpoint on the demo task's candidate questions.

The backbone is frozen: every item's features (z_q, u_i, the six language-model features) are extracted once by
the `batched` executor and cached; only the head is trained on the cache (AdamW, cross-entropy over [candidate
logits, abstain], padded candidates masked out, so a request with N candidates is exactly the engine's softmax).
Binary requests (one candidate statement, P(true) = sigmoid(logit)) come from the same images' `exist` and
`color` questions; their binary cross-entropy, weighted by `binary_weight`, is added to the choice loss, from a
batch stream of their own. For a fraction of the items with three or more candidates the right answer is
removed (at least two stay) and the target is "abstain". The head of the best validation step (pooled accuracy
of every validation request, then the summed loss) is kept, with its test-split figures (`test_report`).
Everything is seeded by `seed`. The command itself is `trimvlm.cli_train.train_head_command`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from trimvlm.errors import InputError
from trimvlm.scoring.engine import run_scoring
from trimvlm.scoring.head import DecisionHead
from trimvlm.scoring.request import ScoreRequest

TEST_IMAGES = 100  # the demo task's standard test items: 100 images, one question per kind
VAL_IMAGES = 50
ABSTAIN_FRACTION = 0.15
EXTRACT_BATCH = 32
BINARY_KINDS = ("exist", "color")  # demo kinds that also become binary requests (one candidate statement)
BINARY_WEIGHT = 0.5


@dataclass
class Item:
    """One scoring question with its target: the right candidate's index, or None when it was removed (the
    head should abstain). A binary item has one candidate statement and target 1 (true) or 0 (false)."""

    image: object
    question: str
    candidates: list[str]
    answer: str
    kind: str
    target: int | None
    binary: bool = False

    @property
    def request(self) -> ScoreRequest:
        return ScoreRequest([self.image], self.question, list(self.candidates), self.binary)


@dataclass
class Settings:
    steps: int = 2000
    items: int = 1200
    seed: int = 0
    width: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-2
    batch_size: int = 128
    eval_every: int = 50
    dropout: float = 0.3  # on the cached z_q and u while training
    abstain_fraction: float = ABSTAIN_FRACTION
    val_images: int = VAL_IMAGES
    binary_weight: float = BINARY_WEIGHT  # of the binary cross-entropy, added to the choice loss
    binary_batch_size: int = 64

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Cached:
    """Padded features of M items: z_q [M, D], u [M, N, D], feats [M, N, F], mask [M, N] (real candidates),
    target [M] (N = abstain; a binary row: 1 true, 0 false), sums [M, N] (log-likelihood readout, -inf on
    padding), kinds [M], binary [M] (bool: binary requests, read as sigmoid(logit_0))."""

    z_q: torch.Tensor
    u: torch.Tensor
    feats: torch.Tensor
    mask: torch.Tensor
    target: torch.Tensor
    sums: torch.Tensor
    kinds: list[str]
    binary: torch.Tensor

    def __len__(self) -> int:
        return len(self.kinds)

    def subset(self, idx) -> Cached:
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.target.device)
        rows = (x[idx] for x in (self.z_q, self.u, self.feats, self.mask, self.target, self.sums))
        return Cached(*rows, [self.kinds[int(i)] for i in idx], self.binary[idx])

    @property
    def abstains(self) -> torch.Tensor:
        """[M] bool: items whose right answer was removed."""
        return (self.target == self.mask.shape[1]) & ~self.binary


# ----------------------------------------------------------------------------------------------- items


def make_items(
    samples, abstain_fraction: float, rng: np.random.Generator, limit: int | None = None
) -> list[Item]:
    """Every QA of every sample (up to `limit`); a fraction of those with >= 3 candidates lose their answer."""
    items = []
    for s in samples:
        for qa in s.qas:
            if qa.answer not in qa.candidates:
                raise InputError(f"demo item {qa.question!r}: its answer {qa.answer!r} is not a candidate")
            target = qa.candidates.index(qa.answer)
            items.append(Item(s.image, qa.question, list(qa.candidates), qa.answer, qa.kind, target))
    items = items[:limit] if limit is not None else items
    eligible = [i for i, it in enumerate(items) if len(it.candidates) >= 3]
    n_abstain = min(len(eligible), round(abstain_fraction * len(items)))
    if n_abstain:
        for i in rng.choice(len(eligible), size=n_abstain, replace=False):
            items[eligible[int(i)]] = without_answer(items[eligible[int(i)]])
    return items


def without_answer(item: Item) -> Item:
    """The same question with its right answer removed: the head should abstain."""
    return replace(item, candidates=[c for c in item.candidates if c != item.answer], target=None)


def make_binary_items(samples, rng: np.random.Generator, kinds=BINARY_KINDS) -> list[Item]:
    """One binary request per QA of a binary kind: `exist` asks the statement "yes" (true when the answer is
    yes); other kinds ask one candidate, the right one with probability 1/2, else a wrong one at random."""
    items = []
    for s in samples:
        for qa in s.qas:
            if qa.kind not in kinds:
                continue
            if qa.kind == "exist":
                statement = "yes"
            else:
                wrong = [c for c in qa.candidates if c != qa.answer]
                statement = qa.answer if rng.random() < 0.5 else wrong[int(rng.integers(len(wrong)))]
            target = int(statement == qa.answer)
            items.append(Item(s.image, qa.question, [statement], qa.answer, qa.kind, target, binary=True))
    return items


# ----------------------------------------------------------------------------------------- features


def extract(
    vlm, items: list[Item], *, batch_size: int = EXTRACT_BATCH, progress=None, label="features"
) -> Cached:
    """Run the frozen backbone once over the items (batched executor, no gradients) and pad their features."""
    task = progress.add_task(label, total=len(items)) if progress is not None else None
    parts = []
    with torch.no_grad():
        for a in range(0, len(items), batch_size):
            chunk = items[a : a + batch_size]
            parts.append(run_scoring(vlm, [it.request for it in chunk], executor="batched")[2])
            if progress is not None:
                progress.advance(task, len(chunk))
    return pad(items, *([x for f in parts for x in getattr(f, k)] for k in ("z_q", "u", "feats", "sums")))


def pad(items: list[Item], z_q, u, feats, sums) -> Cached:
    """The items' features (on the model's device) padded into host tensors: the head trains on the CPU."""
    n = max(len(it.candidates) for it in items)

    def padded(rows, value=0.0):
        return pad_sequence([x.float().cpu() for x in rows], batch_first=True, padding_value=value)

    return Cached(
        z_q=torch.stack([z.float().cpu() for z in z_q]),
        u=padded(u),
        feats=padded(feats),
        mask=torch.arange(n)[None] < torch.tensor([len(it.candidates) for it in items])[:, None],
        target=torch.tensor([n if it.target is None else it.target for it in items]),
        sums=padded(sums, -math.inf),
        kinds=[it.kind for it in items],
        binary=torch.tensor([it.binary for it in items], dtype=torch.bool),
    )


# ---------------------------------------------------------------------------------------------- head


def scores(head: DecisionHead, c: Cached) -> torch.Tensor:
    """[M, N + 1] logits over [candidates (padding at -inf), abstain]."""
    logits, abstain = head(c.z_q, c.u, c.feats)
    logits = logits.masked_fill(~c.mask, -math.inf)
    return torch.cat([logits, abstain[:, None]], dim=1)


def loss_of(head: DecisionHead, c: Cached, binary_weight: float = 1.0) -> torch.Tensor:
    """Cross-entropy over [candidates, abstain] on the choice rows, plus `binary_weight` x the binary
    cross-entropy of sigmoid(logit_0) on the binary rows (each a mean over its own rows)."""
    s = scores(head, c)
    choice, binary = ~c.binary, c.binary
    loss = s.new_zeros(())
    if bool(choice.any()):
        loss = loss + torch.nn.functional.cross_entropy(s[choice], c.target[choice])
    if bool(binary.any()):
        loss = loss + binary_weight * torch.nn.functional.binary_cross_entropy_with_logits(
            s[binary, 0], c.target[binary].to(s.dtype)
        )
    return loss


def predictions(head: DecisionHead, c: Cached) -> torch.Tensor:
    """[M] chosen column: a candidate index, or N (the padded width) for abstain; a binary row: 1 when
    P(true) = sigmoid(logit_0) >= 0.5 (the readout's threshold), else 0."""
    with torch.no_grad():
        s = scores(head, c)
        pred = s.argmax(1)
        if bool(c.binary.any()):
            pred[c.binary] = (torch.sigmoid(s[c.binary, 0]) >= 0.5).long()
        return pred


def accuracy(pred: torch.Tensor, c: Cached, kinds: list[str] | None = None) -> dict:
    """Accuracy per kind (and "all") of predictions against the targets (abstain items included)."""
    ok = (pred == c.target).tolist()
    return {**_by_kind(ok, c.kinds, kinds or sorted(set(c.kinds))), "all": sum(ok) / max(1, len(ok))}


def _by_kind(values: list, item_kinds: list[str], kinds) -> dict:
    """Per kind of `kinds` that has items, the mean of `values` over its items."""
    sel = {kind: [v for v, k in zip(values, item_kinds, strict=True) if k == kind] for kind in kinds}
    return {kind: sum(v) / len(v) for kind, v in sel.items() if v}


def train(
    hidden_size: int,
    train_set: Cached,
    val_set: Cached,
    settings: Settings,
    *,
    binary_train: Cached | None = None,
    binary_val: Cached | None = None,
    progress=None,
) -> tuple[DecisionHead, dict]:
    """AdamW (cosine schedule, input dropout on z_q and u) on the cached features; returns the head of the
    best validation step (pooled accuracy of the choice and binary validation requests, then the summed loss)
    and its history. Each step: a choice batch, plus a binary batch when `binary_train` is given (its own
    seeded order and dropout stream, so the choice stream is the same with or without it). Bitwise
    reproducible for a given seed, thread count and torch build."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        head = DecisionHead(hidden_size, settings.width)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, settings.steps))
    rng = np.random.default_rng([settings.seed, 7])
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)  # the head trains on the host
    choice = _Stream(train_set, settings.batch_size, rng, gen, settings)
    binary = _binary_stream(binary_train, settings)
    val_binary = binary_val if binary_val is not None and len(binary_val) > 0 else None
    best = _Best(accuracy=-1.0, loss=math.inf, step=0)
    best_state = {k: v.clone() for k, v in head.state_dict().items()}
    history = []
    task = progress.add_task("train head", total=settings.steps) if progress is not None else None
    for step in range(1, settings.steps + 1):
        loss = loss_of(head, choice.next())
        if binary is not None:
            loss = loss + loss_of(head, binary.next(), settings.binary_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % settings.eval_every == 0 or step == settings.steps:
            entry = _validate(head, val_set, val_binary, settings.binary_weight)
            history.append({"step": step, "train_loss": float(loss.detach()), **entry})
            if (entry["val_accuracy"], -entry["val_loss"]) > (best.accuracy, -best.loss):
                best = _Best(entry["val_accuracy"], entry["val_loss"], step)
                best_state = {k: v.clone() for k, v in head.state_dict().items()}
        if progress is not None:
            progress.update(task, advance=1, description=f"train head (val acc {best.accuracy:.3f} @ {best.step})")
    head.load_state_dict(best_state)
    return head.eval(), {
        "best_step": best.step,
        "best_val_accuracy": best.accuracy,
        "best_val_loss": best.loss,
        "history": history,
    }


def _binary_stream(binary_train: Cached | None, settings: Settings) -> _Stream | None:
    """The binary requests' batches, with their own seeded order and dropout stream; None without any."""
    if binary_train is None or len(binary_train) == 0 or settings.binary_weight <= 0:
        return None
    rng_b = np.random.default_rng([settings.seed, 8])
    gen_b = torch.Generator(device="cpu").manual_seed(int(rng_b.integers(2**62)))
    return _Stream(binary_train, settings.binary_batch_size, rng_b, gen_b, settings)


def _validate(head: DecisionHead, val_set: Cached, val_binary: Cached | None, binary_weight: float) -> dict:
    """Validation loss and accuracy, pooled over the choice and binary requests (each request counts once)."""
    head.eval()
    with torch.no_grad():
        v_loss = float(loss_of(head, val_set))
        hits, total = int((predictions(head, val_set) == val_set.target).sum()), len(val_set)
        entry = {"val_choice_accuracy": hits / total}
        if val_binary is not None:
            v_loss += float(loss_of(head, val_binary, binary_weight))
            b_hits = int((predictions(head, val_binary) == val_binary.target).sum())
            entry["val_binary_accuracy"] = b_hits / len(val_binary)
            hits, total = hits + b_hits, total + len(val_binary)
    head.train()
    return {**entry, "val_loss": v_loss, "val_accuracy": hits / total}


class _Best(NamedTuple):
    """The best validation so far: its accuracy, loss and step."""

    accuracy: float
    loss: float
    step: int


class _Stream:
    """Seeded batches of one cached set: a fresh permutation whenever the next batch would run past the end,
    input dropout from its own generator."""

    def __init__(self, data: Cached, batch_size: int, rng, gen: torch.Generator, settings):
        self.data, self.rng, self.gen, self.dropout = data, rng, gen, settings.dropout
        self.size = min(batch_size, len(data))
        self.order, self.at = rng.permutation(len(data)), 0

    def next(self) -> Cached:
        if self.at + self.size > len(self.data):
            self.order, self.at = self.rng.permutation(len(self.data)), 0
        batch = self.data.subset(self.order[self.at : self.at + self.size])
        self.at += self.size
        return _dropped(batch, self.dropout, self.gen) if self.dropout > 0 else batch


def _dropped(c: Cached, p: float, gen: torch.Generator) -> Cached:
    """Inverted dropout on the representations (z_q, u) of a training batch; the LM features stay."""

    def drop(x):
        keep = torch.rand(x.shape, generator=gen, device=gen.device) >= p
        return x * keep / (1 - p)

    return replace(c, z_q=drop(c.z_q), u=drop(c.u))


# ----------------------------------------------------------------------------------------- evaluation


def binary_report(head: DecisionHead, c: Cached, kinds=BINARY_KINDS) -> dict:
    """Binary accuracy (P(true) >= 0.5) per kind and overall, with each kind's count and share of true items."""
    pred = predictions(head, c)
    return {
        "accuracy": accuracy(pred, c, [k for k in kinds if k in c.kinds]),
        "items": {k: c.kinds.count(k) for k in kinds if k in c.kinds},
        "true_fraction": _by_kind(c.target.tolist(), c.kinds, kinds),
    }


def test_report(
    head: DecisionHead, full: Cached, removed: Cached, kinds: list[str], binary: Cached | None = None
) -> dict:
    """Head vs log-likelihood accuracy per kind on the test items; abstention with and without the answer;
    binary accuracy per binary kind."""
    n_full, n_removed = full.mask.shape[1], removed.mask.shape[1]
    pred = predictions(head, full)
    loglik = full.sums.argmax(1)
    head_acc = accuracy(pred, full, kinds)
    loglik_acc = accuracy(loglik, full, kinds)
    abst = (pred == n_full).tolist()
    abst_removed = (predictions(head, removed) == n_removed).tolist()
    present = _by_kind(abst, full.kinds, kinds)

    def rate(flags):
        return sum(flags) / len(flags) if flags else None

    return {
        "test_accuracy": head_acc,
        "test_accuracy_loglik": loglik_acc,
        "test_abstention": {
            "answer_present": {
                "rate": rate(abst),
                "by_kind": {k: present.get(k) for k in kinds},
            },
            "answer_removed": {
                "rate": rate(abst_removed),
                "items": len(removed),
                "by_kind": _by_kind(abst_removed, removed.kinds, kinds),
            },
        },
        **({} if binary is None else {f"test_binary_{k}": v for k, v in binary_report(head, binary).items()}),
    }
