"""Train a tiny demo VLM (Qwen3-VL, or the Qwen3.5 hybrid) on the demo task (seeded, resumable, CPU friendly).

Each training sequence is one image followed by several question/answer turns (`Encoder.turns`).

Training-only scaffolds, none of which is in the saved model (docs/demo.md says what each one bought):
the per-cell auxiliary loss through the LM head (`aux_cell_loss`), the attention teacher that tells chosen
heads where to look when an answer is predicted (`AttentionTeacher`), the (colour, shape) pair probe
(`PairProbe`) and the visual fold (`VisualFold`).

The best model by validation skill (accuracy above the majority answer; worst kind + mean) is written
atomically to `out_dir` (the shipped checkpoint folder) with its test accuracy per kind; optimizer, step and
RNG states live in `work_dir` and let a stopped run resume where it left off.

    trimvlm train-demo --out src/trimvlm/demo/checkpoints/qwen3vl --steps 9000 --batch-size 16 --threads 1
    trimvlm train-demo --task scenes --out src/trimvlm/demo/checkpoints/scenes --steps 4500
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trimvlm.demo import task, train_common
from trimvlm.demo.health import HEALTH_IMAGES, scaffold_health
from trimvlm.demo.model import (
    VISUAL_TOKENS,
    build_config,
    build_image_processor,
    build_model,
    save_checkpoint,
)
from trimvlm.demo.train_common import AUX_POSITION_LAYER, Ask, Look, Spec, Turn, aux_cell_loss
from trimvlm.demo.vocab import build_tokenizer, build_vocab
from trimvlm.evals.tasks.demo import split_info
from trimvlm.progress import steps as step_bar

TRAIN_TURNS = {"exist": 5, "mc": 3, "color": 2, "count": 4, "list": 2, "read": 1}
P_DESCRIBE = 0.25
WHERE_TURNS = 2
VAL_IMAGES = 48
TEST_IMAGES = 100


class Encoder(train_common.Encoder):
    """The grid task's encoder: 64 visual tokens per image."""

    def __init__(self):
        super().__init__(task, build_vocab(), build_image_processor(), task.BACKGROUND)
        attributes = task.COLOR_NAMES + task.SHAPES + [f"{a}{i}" for a in "rc" for i in range(task.GRID)]
        self.attribute_ids = {self.vocab[w] for w in attributes}

    def n_visual(self, image) -> int:
        return VISUAL_TOKENS

    def supervise(self, turn: Turn, looks: list[Look], asks: list[Ask], names: list) -> None:
        """A `Look` per turn (the evidence cells, the question's attribute words, the right option's letter
        and words); an `Ask` per existence and multiple-choice question."""
        q, start, prompt = turn.qa, turn.start, turn.prompt
        if q.kind not in ATTENTION_KINDS:
            return
        cells = task.evidence_cells(turn.sample.scene, q.kind, q.params)
        words = [start + i for i, t in enumerate(prompt) if t in self.attribute_ids]
        option = []  # multiple choice: the right option's letter and its two words
        if q.kind == "mc":
            at = start + prompt.index(self.vocab[q.answer])
            option = [at, at + 1, at + 2]
        if q.kind in ("exist", "mc"):
            pairs = q.params["options"] if q.kind == "mc" else [(q.params["color"], q.params["shape"])]
            asks.append(Ask(turn.row, turn.at, [pair_class(c, sh) for c, sh in pairs]))
        cell_keys = [1 + r * task.GRID + c for r, c in cells]
        looks.append(Look(turn.row, turn.at, cell_keys, words, option))

    def token_targets(self, scene: task.Scene) -> dict[str, list[int]]:
        """Per visual token (raster order of cells): its content word, shape word, row word, column word and
        (colour, shape) pair class."""
        g, v = task.GRID, self.vocab
        content, shape, pair = [v[task.BACKGROUND]] * g * g, [-100] * g * g, [NO_PAIR] * g * g
        for o in scene.objects:
            k = o.row * g + o.col
            content[k], shape[k], pair[k] = v[o.color], v[o.shape], pair_class(o.color, o.shape)
        for (r, c), ch in zip(scene.text_cells(), scene.text, strict=True):
            content[r * g + c] = v[ch]
        rows, cols = [v[f"r{k // g}"] for k in range(g * g)], [v[f"c{k % g}"] for k in range(g * g)]
        return {"content": content, "shape": shape, "row": rows, "col": cols, "pair": pair}


class VisualFold:
    """Keeps the visual tokens centred and at text-embedding scale while training, inside the stock weights.

    From scratch, the vision merger's outputs grow a large component shared by every visual token (norm ~75
    against ~0.4 for text embeddings after 600 steps) and the decoder does not learn to look tokens up. After
    each optimizer step this folds a per-dimension affine map y' = a * (y - mean) into the last linear layer
    of the merger and of each deepstack merger (rows of W scaled by a, bias set to a * (b - mean)), using the
    statistics of the batch just seen; a only shrinks (<= 1). The model stays a plain Qwen3-VL.
    """

    def __init__(self, model, target_norm: float = 1.0):
        visual = model.model.visual
        self.mods = [visual.merger, *getattr(visual, "deepstack_merger_list", [])]
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.target = target_norm / math.sqrt(self._last_linear(visual.merger).out_features)
        for i, mod in enumerate(self.mods):
            mod.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(_mod, _inp, out):
            if torch.is_grad_enabled():
                y = out.detach().reshape(-1, out.shape[-1])
                self.stats[i] = (y.mean(0), y.std(0))

        return hook

    @staticmethod
    def _last_linear(mod) -> torch.nn.Linear:
        """The merger's output layer: `linear_fc2` (Qwen3-VL, Qwen3.5) or the last of `mlp` (Qwen2.5-VL)."""
        return mod.linear_fc2 if hasattr(mod, "linear_fc2") else mod.mlp[-1]

    @torch.no_grad()
    def apply(self) -> None:
        for i, mod in enumerate(self.mods):
            if i not in self.stats:
                continue
            mean, std = self.stats.pop(i)
            a = (self.target / std.clamp_min(1e-8)).clamp(max=1.0)
            fc2 = self._last_linear(mod)
            fc2.weight.mul_(a[:, None])
            fc2.bias.copy_(a * (fc2.bias - mean))


def train_samples(rng: np.random.Generator, n: int) -> list[task.Sample]:
    out = []
    for _ in range(n):
        s = task.make_sample(rng, per_kind=TRAIN_TURNS)
        if rng.random() < P_DESCRIBE:
            s.qas.append(task.make_qa(s.scene, "describe", rng))
        s.qas += [task.make_qa(s.scene, "where", rng) for _ in range(WHERE_TURNS)]
        out.append(s)
    return out


@torch.no_grad()
def evaluate(model, enc: Encoder, samples, batch_size: int = 64, max_new_tokens: int = 8) -> dict[str, float]:
    """Greedy exact-match accuracy per kind with the model's own `generate`."""
    model.eval()
    correct: dict[str, list[int]] = {k: [] for k in enc.kinds}
    id2w = {i: w for w, i in enc.vocab.items()}
    chunks = []
    for probe, n_new in (("prefill", 2), ("full", max_new_tokens)):
        items = [(s.image, q) for s in samples for q in s.qas if q.probe == probe and q.kind in enc.kinds]
        chunks += [(items[b : b + batch_size], n_new) for b in range(0, len(items), batch_size)]
    for chunk, n_new in chunks:
        batch = enc.prompt_batch([(im, q.question) for im, q in chunk])
        out = model.generate(**batch, max_new_tokens=n_new, do_sample=False)
        new = out[:, batch["input_ids"].shape[1] :]
        for (_, q), row in zip(chunk, new.tolist(), strict=True):
            words = [id2w.get(t, "<unk>") for t in takewhile(lambda t: t not in (enc.eos, enc.pad), row)]
            correct[q.kind].append(int(" ".join(words) == q.answer))
    model.train()
    return {k: float(np.mean(v)) if v else 0.0 for k, v in correct.items()}


ATTENTION_KINDS = ("exist", "mc", "color", "count", "list", "read")
ATTENTION_LAYERS = (2, 3, 4)
WORD_LAYERS = (1,)  # the first hop: the answer position gathers the question's attribute words
OPTION_LAYERS = (5,)  # the last hop (multiple choice): back to the option that was found
ATTENTION_HEAD = 0


def uniform_rows(columns: list[list[int]], n: int) -> torch.Tensor:
    """[len(columns), n]: row i spreads 1 evenly over the listed columns (an empty list leaves a zero row)."""
    out = torch.zeros(len(columns), n)
    for i, cols in enumerate(columns):
        if cols:
            out[i, cols] = 1.0 / len(cols)
    return out


class AttentionTeacher:
    """Training-only supervision of where attention looks when the answer is predicted (docs/demo.md says
    why): head `head` of each decoder layer in `layers`, at the position that predicts the first answer word,
    is told to spread its attention evenly over the question's evidence (`Look.keys`) plus the
    <|vision_start|> token as a sink; the other roles' layers look at the question's words, the right option
    or, on `verdict_layers`, the asked word when the answer is yes and the sink when it is no. The weights
    come from eager attention through forward hooks; the model stays a plain transformers model. In a hybrid
    stack each layer index moves to the next full-attention layer.

    `rows_only`: the model keeps SDPA and the teacher's own attention function (`_rows_attention`) computes
    the weights of the supervised query rows alone (two heads, from the query and key states the layer
    hands it), told beforehand by `expect(looks)`: the same weights, without an eager [L, L] matrix per layer.
    """

    def __init__(
        self,
        model,
        layers: tuple[int, ...] = ATTENTION_LAYERS,
        word_layers: tuple[int, ...] = WORD_LAYERS,
        option_layers: tuple[int, ...] = OPTION_LAYERS,
        head: int = ATTENTION_HEAD,
        rows_only: bool = False,
        verdict_layers: tuple[int, ...] = (),
    ):
        self.head = head
        self.rows_only = rows_only
        self.query: tuple[torch.Tensor, torch.Tensor] | None = None
        self.weights: dict[int, torch.Tensor] = {}
        types = getattr(model.config.text_config, "layer_types", None)
        full = [i for i, t in enumerate(types) if t == "full_attention"] if types is not None else None

        depth = model.config.text_config.num_hidden_layers

        def place(ls):  # in a hybrid stack, the next full-attention layer; none past the stack (small models)
            ls = [x for x in ls if x < depth]
            return set(ls) if full is None else {next((i for i in full if i >= x), full[-1]) for x in ls}

        roles = {"cells": layers, "words": word_layers, "option": option_layers, "verdict": verdict_layers}
        self.roles = {layer: role for role, ls in roles.items() for layer in place(ls)}  # the later role wins
        attn = {layer: model.model.language_model.layers[layer].self_attn for layer in self.roles}
        if rows_only:
            AttentionInterface.register(ROWS_ATTENTION, _rows_attention)
            # SDPA's masks too: an attention name with no mask function gets no mask at all (transformers),
            # which right-padded training batches survive and left-padded generation (validation) does not
            AttentionMaskInterface.register(ROWS_ATTENTION, sdpa_mask)
            for mod in attn.values():
                mod.rows_teacher = self  # read by `_rows_attention`, which keys the weights by `mod.layer_idx`
            model.set_attn_implementation(ROWS_ATTENTION)
        else:
            model.set_attn_implementation("eager")
            for layer, mod in attn.items():
                mod.register_forward_hook(self._hook(layer))

    def expect(self, looks: list[Look]) -> None:
        """The (row, position) queries the next forward's weights are wanted for (rows_only)."""
        self.query = (torch.tensor([look.row for look in looks]), torch.tensor([look.at for look in looks]))

    def weights_of(self, w: torch.Tensor, rows, pos, head: int) -> torch.Tensor:
        """Head `head`'s attention rows at (`rows`, `pos`) in a layer's recorded weights `w`."""
        return w[:, head - self.head] if self.rows_only else w[rows, head, pos]

    def _hook(self, layer: int):
        def hook(_mod, _inp, out):
            if torch.is_grad_enabled():
                self.weights[layer] = out[1]

        return hook

    def loss(self, looks: list[Look]) -> torch.Tensor:
        weights, self.weights = self.weights, {}
        if not weights or not looks:
            return torch.zeros(())
        rows = torch.tensor([look.row for look in looks])
        pos = torch.tensor([look.at for look in looks])
        n = next(iter(weights.values())).shape[-1]
        targets = {
            "cells": uniform_rows([[0, *look.keys] for look in looks], n),  # <|vision_start|> is the sink
            "words": uniform_rows([list(look.words) for look in looks], n),
            "option": uniform_rows([list(look.option) for look in looks], n),
            "verdict": uniform_rows([list(look.verdict) for look in looks], n),
        }
        second = {  # the next head's, at the "cells" and "words" layers (a second object)
            "cells": uniform_rows([[0, *look.second] if look.second else [] for look in looks], n),
            "words": uniform_rows([list(look.second_words) for look in looks], n),
        }
        terms = []
        for layer, w in weights.items():
            role = self.roles[layer]
            pairs = [(targets[role], self.head)]
            if role in second and second[role].sum() > 0:
                pairs.append((second[role], self.head + 1))
            for target, head in pairs:
                if target.sum() > 0:
                    ce = -(target * self.weights_of(w, rows, pos, head).clamp_min(1e-9).log()).sum(-1)
                    terms.append(ce.sum() / target.sum())
        return torch.stack(terms).mean()


ROWS_ATTENTION = "trimvlm_teacher_rows"


def _rows_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA's output; for a layer an `AttentionTeacher(rows_only=True)` tracks (`module.rows_teacher`), while
    grad is on, also the softmax weights of its expected query rows for its two heads ([n, 2, L], kept on the
    teacher)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]
    teacher = getattr(module, "rows_teacher", None)
    if teacher is None or not torch.is_grad_enabled() or teacher.query is None:
        return out, None
    rows, pos = teacher.query
    heads = [teacher.head, teacher.head + 1]
    group = query.shape[1] // key.shape[1]
    q = query[rows[:, None], torch.tensor(heads)[None], pos[:, None]]  # [n, 2, d]
    k = key[rows[:, None], torch.tensor([h // group for h in heads])[None]]  # [n, 2, L, d]
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    scores = torch.einsum("nhd,nhld->nhl", q, k) * scale
    n_keys = key.shape[2]
    valid = torch.arange(n_keys)[None] <= pos[:, None]
    if attention_mask is not None:
        m = attention_mask[rows, 0, pos, :n_keys]
        if m.dtype == torch.bool:
            valid = valid & m
        else:
            scores = scores + m[:, None]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    teacher.weights[module.layer_idx] = scores.softmax(-1)
    return out, None


NO_PAIR = len(task.COLOR_NAMES) * len(task.SHAPES)


def pair_class(color: str, shape: str) -> int:
    return task.COLOR_NAMES.index(color) * len(task.SHAPES) + task.SHAPES.index(shape)


class PairProbe(torch.nn.Module):
    """Training-only linear read-out of the (colour, shape) pair, shared by keys and queries.

    Existence and multiple choice match a conjunction; with colour and shape as separate features a red
    square and a blue circle each half-match "red circle" and the search stays blurred. This probe reads the
    hidden state after decoder layer `AUX_POSITION_LAYER` (where the search reads its keys and query) and
    must name the pair both at each object's visual token and at the answer position of an existence
    question (the pair asked for; for multiple choice, evenly the four option pairs), so one direction per
    pair is written on both sides. It has its own optimizer and is never saved into the checkpoint.
    """

    def __init__(self, hidden: int, lr: float, n_pairs: int = NO_PAIR):
        super().__init__()
        self.n_pairs = n_pairs
        self.linear = torch.nn.Linear(hidden, n_pairs + 1)
        self.opt = torch.optim.AdamW(self.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def loss(self, model, out, pair: torch.Tensor, asks: list[Ask]) -> torch.Tensor:
        h = model.model.language_model.norm(out.hidden_states[AUX_POSITION_LAYER])
        ce = torch.nn.functional.cross_entropy
        loss = ce(self.linear(h[:, 1 : 1 + pair.shape[1]]).reshape(-1, self.n_pairs + 1), pair.reshape(-1))
        if asks:
            rows = torch.tensor([a.row for a in asks])
            pos = torch.tensor([a.at for a in asks])
            loss = loss + ce(self.linear(h[rows, pos]), uniform_rows([a.pairs for a in asks], self.n_pairs + 1))
        return loss


BEST_METRIC = "skill-min+mean"


def majority_baseline(samples, kinds=None) -> dict[str, float]:
    """Per kind, the accuracy of always giving the most frequent answer."""
    answers = {k: Counter(q.answer for s in samples for q in s.qas if q.kind == k)
               for k in (kinds if kinds is not None else task.KINDS)}  # fmt: skip
    return {k: max(c.values()) / c.total() if c else 0.0 for k, c in answers.items()}


def selection_score(acc: dict[str, float], base: dict[str, float]) -> float:
    """Worst + mean skill over kinds, skill = accuracy above the majority answer's, scaled to [0, 1].

    A kind still answered with one constant word scores 0 whichever word it is, so its flips between
    "yes" and "no" do not decide which checkpoint is kept.
    """
    skill = [max(0.0, acc[k] - base[k]) / max(1e-9, 1 - base[k]) for k in acc]
    return min(skill) + float(np.mean(skill))


def warm_start(model, folder: str | Path) -> int:
    """Copy every parameter of the checkpoint in `folder` whose name and shape match; returns how many.

    Used to start the hybrid demo model from the trained Qwen3-VL one: vision tower, merger, embeddings,
    LM head, norms and MLPs carry over; the token mixers (Gated DeltaNet, gated attention) start fresh.
    Qwen3.5's RMSNorm scales by (1 + w) and starts at w = 0 where Qwen3-VL's scales by w: such a fresh
    all-zero norm weight takes the source weight minus one.
    """
    src = load_file(str(Path(folder) / "model.safetensors"))
    own = model.state_dict()
    hits = {k: v for k, v in src.items() if k in own and own[k].shape == v.shape}
    for k, v in hits.items():
        if "norm" in k and v.ndim == 1 and not own[k].any():
            hits[k] = v - 1.0
    model.load_state_dict(hits, strict=False)
    return len(hits)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))


@dataclass
class _Run:
    """A training run's mutable state: what `_save_state` writes and `_resume` restores."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    rng: np.random.Generator
    fold: VisualFold | None
    teacher: AttentionTeacher | None
    probe: PairProbe | None
    step: int = 0
    best: float = -1.0


def _setup(
    config, seed: int, lr: float, warm_from, fold_visual: bool, attention_weight: float, pair_probe: bool,
    aux_weight: float, spec: Spec,
) -> _Run:  # fmt: skip
    """The seeded model (warm-started from `warm_from` when given), its AdamW, the training scaffolds, then
    the training stream's numpy generator and the torch seed, in this order (the order of the random draws)."""
    model = build_model(config, seed=seed)
    if warm_from is not None:
        print(f"warm start: {warm_start(model, warm_from)} tensors from {warm_from}", flush=True)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    fold = VisualFold(model) if fold_visual else None
    teacher = AttentionTeacher(model, **spec.teacher) if attention_weight > 0 else None
    hidden = config.text_config.hidden_size
    probe = PairProbe(hidden, lr, spec.n_pairs) if pair_probe and aux_weight > 0 else None
    rng = spec.task.split_rng("train", seed)
    torch.manual_seed(seed)
    return _Run(model, opt, rng, fold, teacher, probe)


def _resume(run: _Run, state_path: Path, out_dir: Path) -> None:
    """Restore the model, optimizer, RNG states, step and best score saved in `state_path`."""
    st = torch.load(state_path, weights_only=False)
    run.model.load_state_dict(st["model"])
    run.opt.load_state_dict(st["optimizer"])
    run.rng.bit_generator.state = st["np_rng"]
    torch.set_rng_state(st["torch_rng"])
    run.step, run.best = st["step"], st["best"]
    if run.probe is not None and "pair_probe" in st:
        run.probe.load_state_dict(st["pair_probe"])
        run.probe.opt.load_state_dict(st["pair_probe_opt"])
    if not out_dir.exists() or st.get("best_metric") != BEST_METRIC:
        run.best = -1.0  # a new output folder, or a state saved under another selection rule: re-select
    print(f"resumed from {state_path} at step {run.step} (best min-kind val acc {run.best:.3f})", flush=True)


def _save_state(run: _Run, state_path: Path, model_kwargs: dict | None) -> None:
    """Write the resumable state atomically (a temporary file, then a rename)."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.opt.state_dict(),
        "np_rng": run.rng.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "step": run.step,
        "best": run.best,
        "best_metric": BEST_METRIC,
        "model_kwargs": model_kwargs or {},
    }
    if run.probe is not None:
        state.update(pair_probe=run.probe.state_dict(), pair_probe_opt=run.probe.opt.state_dict())
    tmp = state_path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(state_path)


def _log(log_path: Path, rec: dict) -> None:
    with log_path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _train_step(
    run: _Run, enc: Encoder, steps: int, batch_size: int, lr: float, warmup: int, aux_weight: float,
    attention_weight: float, spec: Spec,
) -> tuple[float, float | None]:  # fmt: skip
    """One optimizer step on a fresh batch (then the probe's step and the visual fold); advances `run.step`.
    Returns the batch's total loss and its attention-teacher loss (None without a teacher)."""
    model, opt, probe = run.model, run.opt, run.probe
    for g in opt.param_groups:
        g["lr"] = lr_at(run.step, steps, lr, warmup)
    samples = spec.train_samples(run.rng, batch_size)
    batch = enc.train_batch(samples, run.rng)
    looks, asks, names = batch.pop("looks"), batch.pop("asks"), batch.pop("names", [])
    if run.teacher is not None and run.teacher.rows_only:
        run.teacher.expect(looks)
    if aux_weight > 0:
        out = model(**batch, output_hidden_states=True)
        targets = enc.cell_targets(samples)
        targets["names"] = names  # (row, position, word id): words a task's positions name mid-way
        loss = out.loss + aux_weight * spec.aux_loss(model, out, targets)
        if probe is not None:
            loss = loss + aux_weight * probe.loss(model, out, targets["pair"], asks)
    else:
        loss = model(**batch).loss
    att_loss = None
    if run.teacher is not None:
        run.teacher.query = None
        att = run.teacher.loss(looks)
        att_loss = att.item()
        loss = loss + attention_weight * att
    opt.zero_grad(set_to_none=True)
    if probe is not None:
        probe.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if probe is not None:
        for g in probe.opt.param_groups:
            g["lr"] = opt.param_groups[0]["lr"]
        probe.opt.step()
    if run.fold is not None:
        run.fold.apply()
    run.step += 1
    return loss.item(), att_loss


def _validate(
    run: _Run, enc: Encoder, val: list, test: list, out_dir: Path, tokenizer, train_meta: dict, spec: Spec,
    log_path: Path,
) -> str:  # fmt: skip
    """Validation accuracy and selection score at `run.step`; when the score beats the best so far, the test
    accuracy too, and the checkpoint is written to `out_dir`. Logs the record; returns the console line."""
    acc = evaluate(run.model, enc, val)
    score = selection_score(acc, majority_baseline(val, enc.kinds))
    rec = {"step": run.step, "val": acc, "val_score": score}
    if run.teacher is not None or run.probe is not None:
        rec["scaffolds"] = scaffold_health(run, enc, val[:HEALTH_IMAGES], AUX_POSITION_LAYER)
    improved = score > run.best
    if improved:
        run.best = score
        test_acc = evaluate(run.model, enc, test)
        rec["test"] = test_acc
        meta = {
            "step": run.step,
            "val_accuracy": acc,
            "test_accuracy": test_acc,
            "test_items": split_info("test", 0, test),
            "train": dict(train_meta),
            **spec.meta,
        }
        save_checkpoint(run.model, out_dir, meta, tokenizer, spec.image_processor())
    _log(log_path, rec)
    line = f"step {run.step} val " + " ".join(f"{k}={v:.2f}" for k, v in acc.items())
    return line + (" *best" if improved else "")


def train_demo(
    out_dir: str | Path,
    steps: int,
    seed: int = 0,
    resume: bool = True,
    batch_size: int = 32,
    lr: float = 2e-3,
    threads: int = 2,
    work_dir: str | Path | None = None,
    eval_every: int = 300,
    save_every: int = 100,
    warmup: int = 300,
    model_kwargs: dict | None = None,
    progress: bool = True,
    fold_visual: bool = True,
    init_from: str | Path | None = None,
    aux_weight: float = 0.5,
    attention_weight: float = 1.0,
    pair_probe: bool = True,
    spec: Spec | None = None,
) -> Path:
    """Train (or resume) a demo model into `out_dir` (the grid task's unless `spec` names another); logs and
    resumable state in `work_dir`."""
    torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / f"train-{out_dir.name}"
    work_dir.mkdir(parents=True, exist_ok=True)
    state_path, log_path = work_dir / "train_state.pt", work_dir / "train_log.jsonl"

    spec = spec if spec is not None else GRID_SPEC
    tokenizer = spec.tokenizer()
    config = spec.build_config(tokenizer, **(model_kwargs or {}))
    resuming = resume and state_path.exists()
    warm_from = init_from if init_from is not None and not resuming else None
    run = _setup(config, seed, lr, warm_from, fold_visual, attention_weight, pair_probe, aux_weight, spec)
    if resuming:
        _resume(run, state_path, out_dir)

    enc = spec.encoder()
    val, test = (spec.task.generate_split(s, n, seed=0) for s, n in (("val", VAL_IMAGES), ("test", TEST_IMAGES)))
    n_params = sum(p.numel() for p in run.model.parameters())
    print(f"model: {n_params:,} parameters; training steps {run.step}..{steps}", flush=True)
    train_meta = {"seed": seed, "batch_size": batch_size, "lr": lr, "steps_planned": steps}

    window = _Window(log_path)
    with step_bar("train-demo", steps, enabled=progress, phase="training", done=run.step) as bar:
        while run.step < steps:
            loss = _train_step(run, enc, steps, batch_size, lr, warmup, aux_weight, attention_weight, spec)
            window.add(*loss)
            bar.advance()
            if run.step % 50 == 0:
                bar.phase(f"training, loss {window.log(run)['loss']:.3f}")
            if run.step % eval_every == 0 or run.step == steps:
                bar.phase(f"validating at step {run.step}")
                bar.note(_validate(run, enc, val, test, out_dir, tokenizer, train_meta, spec, log_path))
                bar.phase("training")
                window.t_last = time.time()
            if run.step % save_every == 0 or run.step == steps:
                _save_state(run, state_path, model_kwargs)
    return out_dir


class _Window:
    """The losses of the steps since the last log line (every 50 steps), with their time."""

    def __init__(self, log_path: Path):
        self.log_path, self.losses, self.att_losses, self.t_last = log_path, [], [], time.time()

    def add(self, loss: float, att: float | None) -> None:
        self.losses.append(loss)
        self.att_losses += [] if att is None else [att]

    def log(self, run: _Run) -> dict:
        """Log the mean losses of the last steps (and the attention loss when it was trained); start anew."""
        rec = {"step": run.step, "loss": float(np.mean(self.losses)), "lr": run.opt.param_groups[0]["lr"],
               "s_per_step": (time.time() - self.t_last) / 50}  # fmt: skip
        if self.att_losses:
            rec["attention_loss"] = float(np.mean(self.att_losses))
        _log(self.log_path, rec)
        self.losses, self.att_losses, self.t_last = [], [], time.time()
        return rec


GRID_SPEC = Spec(task=task, encoder=Encoder, tokenizer=build_tokenizer, build_config=build_config,
                 train_samples=train_samples, aux_loss=aux_cell_loss, n_pairs=NO_PAIR,
                 image_processor=build_image_processor)  # fmt: skip
