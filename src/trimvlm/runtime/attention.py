"""The attention function trimvlm runs transformers' attention modules with.

Registered once under its own name in transformers' `AttentionInterface` (adding a name, replacing nothing), with
SDPA's mask function under the same name in `AttentionMaskInterface`, and selected once, when a runner takes the
model, on its decoder only (`select_attention`: transformers' `set_attn_implementation` on the text model; the
vision tower and the model's other configs keep theirs). Without a context (the model's own forward, a user's
other code) it is transformers' own SDPA path, masks included, so the model answers as before. With one it can
- attend to a shared prefix cache plus each branch's own keys, merging the two parts exactly (log-sum-exp),
  so N branches read one prefix without copying it;
- record the attention rows a method asks for (FastV's last-query row, SnapKV's window, H2O's column sums),
  computing only those query rows, never switching the model to eager attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trimvlm.kernels.flops import matmul
from trimvlm.runtime.cache import RowRun, owner_runs

NAME = "trimvlm_sdpa"


@dataclass
class AttentionProbe:
    """Record attention probabilities in the given layers, computing only what is asked, never switching the
    model to eager attention:

    - rows (default): the softmax rows of the last `last` query rows of a chunk (an extra [B, H, last, K]
      score block). `results[i]` = [B, last, K], heads averaged (or [B, H, last, K] with `per_head`);
      `row_valid[i]` = [B, last] which of those rows are real tokens (False on padding).
    - `colsum`: the attention every key receives summed over *all* real query rows of the chunk and over the
      heads (column sums of the causal softmax, H2O's accumulated attention), computed in query blocks of
      `block` rows: memory O(block * K), never an N x N matrix. `results[i]` = [B, K].

    `layers` None means every attention layer. The extra score products are method FLOPs.
    """

    last: int = 1
    layers: set[int] | None = None
    per_head: bool = False
    colsum: bool = False
    block: int = 256
    results: dict[int, torch.Tensor] = field(default_factory=dict)
    row_valid: dict[int, torch.Tensor] = field(default_factory=dict)
    chunk_valid: torch.Tensor | None = None  # set by the runner for the current chunk

    def wants(self, layer_idx) -> bool:
        return self.layers is None or layer_idx in self.layers

    def merge(self, other: AttentionProbe | ProbeSet | None) -> AttentionProbe | ProbeSet:
        """One probe object recording for both (each keeps reading its own `results`)."""
        return self if other is None else ProbeSet([self]).merge(other)

    def record(self, layer_idx, query, key, mask, scaling) -> None:
        b, _, q, _ = query.shape
        if not self.colsum:
            n = min(self.last, q)
            p = _probs(query, key, mask, q - n, q, scaling)
            self.results[layer_idx] = p if self.per_head else p.mean(1)
            if self.chunk_valid is not None:
                self.row_valid[layer_idx] = self.chunk_valid[:, q - n :]
            return
        acc = torch.zeros(b, key.shape[2], dtype=torch.float32, device=query.device)
        for s in range(0, q, self.block):
            e = min(q, s + self.block)
            # a padding row that sees no key: 0
            p = torch.nan_to_num(_probs(query, key, mask, s, e, scaling), nan=0.0)
            if self.chunk_valid is not None:
                p = p * self.chunk_valid[:, None, s:e, None].to(p.dtype)
            acc += p.sum(dim=(1, 2))
        self.results[layer_idx] = acc


@dataclass
class ProbeSet:
    """Several methods' probes recorded in one run; each member computes and keeps its own results."""

    members: list[AttentionProbe]
    chunk_valid: torch.Tensor | None = None  # set by the runner, handed to each member that records

    def wants(self, layer_idx) -> bool:
        return any(p.wants(layer_idx) for p in self.members)

    def merge(self, other) -> ProbeSet:
        if other is None:
            return self
        return ProbeSet(self.members + (other.members if isinstance(other, ProbeSet) else [other]))

    def record(self, layer_idx, query, key, mask, scaling) -> None:
        for p in self.members:
            if p.wants(layer_idx):
                p.chunk_valid = self.chunk_valid
                p.record(layer_idx, query, key, mask, scaling)


@dataclass
class AttentionContext:
    shared: list | None = None  # SharedPart list (cache.py): read-only KV attended before the branch's own
    probe: AttentionProbe | None = None
    vision: object | None = None  # a vision-tower probe the image encoding records (PruMerge, VisionZip)
    tree: object | None = None  # a TreeSchedule: rows are trie chains that also attend to their ancestors

    def layer_parts(self, layer_idx) -> list:
        return [p for p in self.shared or [] if layer_idx in p.layers]

    def shares(self, layer_idx) -> bool:
        return self.tree is not None or bool(self.layer_parts(layer_idx))


class Attended(NamedTuple):
    """One part's attention: its output [B, H, Q, d] and the log-sum-exp of its scores [B, H, Q]."""

    out: torch.Tensor
    lse: torch.Tensor


def _grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    b, h, q, d = query.shape
    return query.reshape(b, n_kv, (h // n_kv) * q, d)


def _expand_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, 1, Q, K] -> [B, 1, G*Q, K] in the same order as _grouped (group-major, then query)
    b, one, q, k = mask.shape
    return mask[:, :, None].expand(b, one, groups, q, k).reshape(b, one, groups * q, k)


def _probs(query, key, mask, start: int, end: int, scaling) -> torch.Tensor:
    """[B, H, end - start, K] float softmax of the query rows [start, end) of a chunk (extra score rows:
    method FLOPs); `mask` is the chunk's bool mask, None for a plain causal chunk over no past (query i sees
    the keys <= i + K - Q)."""
    b, h, q, _ = query.shape
    k = key.shape[2]
    if mask is None:
        rows = torch.arange(start, end, device=query.device)[:, None] + (k - q)
        mask = (torch.arange(k, device=query.device)[None] <= rows)[None, None]
    else:
        mask = mask[:, :, start:end, :]
    s = (matmul(_grouped(query[:, :, start:end], key.shape[1]), key.transpose(-1, -2)) * scaling).float()
    s = s.masked_fill(~_expand_mask(mask, h // key.shape[1]), float("-inf"))
    return torch.softmax(s, dim=-1).reshape(b, h, end - start, -1)


def trimvlm_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    trimvlm_ctx: AttentionContext | None = None,
    **kwargs,
):
    ctx = trimvlm_ctx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer_idx = getattr(module, "layer_idx", None)
    if ctx is not None and ctx.probe is not None and ctx.probe.wants(layer_idx):
        ctx.probe.record(layer_idx, query, key, attention_mask, scaling)
    if ctx is None or not ctx.shares(layer_idx):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=None if attention_mask is None else False,  # None: a plain causal chunk
            **kwargs,
        )
    return _shared_attention(ctx, layer_idx, query, key, value, attention_mask, scaling), None


def _shared_attention(ctx: AttentionContext, layer_idx, query, key, value, attention_mask, scaling):
    """Shared parts + own keys: one exact softmax over all of them, computed part by part with each part's
    log-sum-exp and merged; a shared part is never copied per branch. A tree's rows also attend to their
    ancestors: with one shared part and few runs of rows that share their context (`TreeSchedule.context_runs`),
    prefix and ancestors are one part, one call per run; otherwise the ancestors are gathered per row and
    attended in one more call."""
    b, h, q, d = query.shape
    n_kv = key.shape[1]
    parts = ctx.layer_parts(layer_idx)
    tree = ctx.tree
    runs = tree.context_runs(parts[0].owner) if tree is not None and len(parts) == 1 else None
    if runs is not None:
        return _tree_attention(query, key, value, attention_mask, parts[0].layers[layer_idx], runs, scaling)
    outs = [_shared_part(query, part.layers[layer_idx], part.owner, scaling) for part in parts]
    anc = None if tree is None else tree.ancestors >= 0  # [C, A] each chain's real ancestors
    if anc is not None and anc.shape[1]:  # each chain's ancestors, whose keys this same call computed
        ka, va = _ancestor_kv(key, tree.ancestors), _ancestor_kv(value, tree.ancestors)
        o, lse = _attend(_grouped(query, n_kv), ka, va, anc[:, None, None, :], scaling)
        none = ~anc.any(1)[:, None, None]  # chains without ancestors
        lse = lse.reshape(b, h, q).masked_fill(none, float("-inf"))
        outs.append(Attended(_ungrouped(o, h), lse))
    g = h // n_kv
    outs.append(
        _attend(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), attention_mask, scaling)
    )
    return _merge(outs).to(query.dtype).transpose(1, 2).contiguous()


def _merge(outs: list[Attended]) -> torch.Tensor:
    """The exact softmax over all parts from each part's output and log-sum-exp: sum of out x exp(lse - lse of
    all), accumulated in place (float). A part a row cannot see has lse = -inf there and adds nothing (`_attend`
    leaves its out finite, 0 on every device)."""
    lse_all = outs[0].lse
    for part in outs[1:]:
        lse_all = torch.logaddexp(lse_all, part.lse)
    acc = outs[0].out.float() * torch.exp(outs[0].lse - lse_all).unsqueeze(-1)
    for part in outs[1:]:
        acc.addcmul_(part.out.float(), torch.exp(part.lse - lse_all).unsqueeze(-1))
    return acc


def _tree_attention(query, key, value, mask, kv, runs, scaling):
    """A tree's rows over two parts: their context (the prefix row and the ancestors; per run of rows with the
    same context, their queries folded into one call against [prefix keys | ancestor keys], the ancestors'
    keys gathered once per run) and their own keys (causal within the row). Written in the output's
    [B, Q, H, d] layout: one copy of the queries per run, one of the context's out, the merge in place."""
    b, h, q, d = query.shape
    n_kv = key.shape[1]
    g = h // n_kv
    acc = torch.empty(b, q, n_kv, g, d, dtype=torch.float32, device=query.device)
    lse_ctx = torch.empty(b, q, n_kv, g, dtype=torch.float32, device=query.device)
    flat_k, flat_v = (x.transpose(1, 2).reshape(-1, n_kv, d) for x in (key, value))  # [C * L, Hk, d]
    for a, e, o, idx in runs:
        n = e - a
        qf = query[a:e].reshape(n, n_kv, g, q, d).transpose(0, 1).reshape(1, n_kv, n * g * q, d)
        ks, vs, valid = kv.key[o : o + 1], kv.value[o : o + 1], kv.valid[o]
        if idx.numel():
            ks = torch.cat([ks, flat_k.index_select(0, idx).transpose(0, 1)[None]], dim=2)
            vs = torch.cat([vs, flat_v.index_select(0, idx).transpose(0, 1)[None]], dim=2)
            valid = torch.cat([valid, valid.new_ones(idx.numel())])
        out, lse = _attend(qf, ks, vs, valid[None, None, None, :], scaling)
        acc[a:e] = out.reshape(n_kv, n, g, q, d).permute(1, 3, 0, 2, 4)
        lse_ctx[a:e] = lse.reshape(n_kv, n, g, q).permute(1, 3, 0, 2)
    own, lse_own = _attend(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), mask, scaling)
    acc, lse_ctx = acc.view(b, q, h, d), lse_ctx.view(b, q, h)
    lse_own = lse_own.transpose(1, 2)
    lse_all = torch.logaddexp(lse_ctx, lse_own)
    acc.mul_(torch.exp(lse_ctx - lse_all).unsqueeze(-1))
    acc.addcmul_(own.transpose(1, 2).float(), torch.exp(lse_own - lse_all).unsqueeze(-1))
    return acc.to(query.dtype)


def _attend(query, key, value, mask, scaling) -> Attended:
    """softmax(q k^T * scaling, masked) v and its log-sum-exp for one part. `mask` is bool, broadcastable to
    [B, 1, Q, K]; every row must see at least one key (callers mask the rest)."""
    add = None
    if mask is not None:
        add = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, float("-inf")
        )
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=add, scale=scaling
        )
        return Attended(out, lse.float())
    s = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if add is not None:
        s = s + add.float()
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)  # a row that sees no key: out 0 (as the CPU kernel)
    return Attended(torch.matmul(torch.exp(s - safe[..., None]).to(value.dtype), value), lse)


def _ancestor_kv(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[C, Hk, L, d] keys or values of the chunk -> [C, Hk, A, d] those of each row's ancestor nodes."""
    c, hk, length, d = x.shape
    flat = x.transpose(1, 2).reshape(c * length, hk, d)
    return flat.index_select(0, idx.clamp(min=0).flatten()).view(*idx.shape, hk, d).transpose(1, 2)


def _ungrouped(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, Hk, G*Q, d] (grouped by kv head) -> [B, H, Q, d]."""
    b, n_kv, gq, d = x.shape
    return x.reshape(b, h, gq // (h // n_kv), d)


def _shared_part(query, kv, owner, scaling):
    """Attention of branches to one shared part: the branches that read one row are folded into the query
    axis of one call against that row's keys (no per-branch copy of the part). Rows whose owner is -1 do not
    read the part (rows of a batch joined with others, `KVCache.join`): out 0, log-sum-exp -inf."""
    b, h, q, d = query.shape
    n_kv = kv.key.shape[1]
    grouped = _grouped(query, n_kv)  # [B, Hk, G*Q, d]
    outs, lses = [], []
    for a, e, o in owner_runs(owner) if kv.key.shape[0] > 1 or bool((owner < 0).any()) else [RowRun(0, b, 0)]:
        n = e - a
        if o < 0:
            outs.append(grouped.new_zeros(n, n_kv, grouped.shape[2], d))
            lses.append(torch.full((n, n_kv, grouped.shape[2]), float("-inf"), device=query.device))
            continue
        qf = grouped[a:e].transpose(0, 1).reshape(1, n_kv, n * grouped.shape[2], d)
        mask = kv.valid[o][None, None, None, :]
        out, lse = _attend(qf, kv.key[o : o + 1], kv.value[o : o + 1], mask, scaling)
        outs.append(out.reshape(n_kv, n, -1, d).transpose(0, 1))
        lses.append(lse.reshape(n_kv, n, -1).transpose(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses) if len(lses) > 1 else lses[0]
    return Attended(_ungrouped(out, h), lse.reshape(b, h, q))


AttentionInterface.register(NAME, trimvlm_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the model's own forward builds SDPA's masks for it


def select_attention(text_model) -> None:
    """Select trimvlm's attention on the decoder `text_model` (the module its attention layers' config belongs
    to), through transformers' own setter: once, when a runner takes the model, and again only if someone set
    another implementation since."""
    if text_model.config._attn_implementation != NAME:
        text_model.set_attn_implementation(NAME)
