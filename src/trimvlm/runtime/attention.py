"""The attention function trimvlm runs transformers' attention modules with.

Registered under its own name in transformers' `AttentionInterface` (adding a name, replacing nothing), and
selected only while the runner drives a model (`use_trimvlm_attention`), so a user's other code sees the model
unchanged. Without a context it is transformers' own SDPA path. With one it can
- attend to a shared prefix cache plus each branch's own keys, merging the two parts exactly (log-sum-exp),
  so N branches read one prefix without copying it;
- record the attention rows a method asks for (FastV's last-query row, SnapKV's window, H2O's column sums),
  computing only those query rows, never switching the model to eager attention.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trimvlm.kernels.flops import matmul
from trimvlm.runtime.cache import owner_runs

NAME = "trimvlm_sdpa"


@dataclass
class AttentionProbe:
    """Record attention probabilities of the last `last` query rows of a chunk in the given layers.

    Only those rows are computed (an extra [B, H, last, K] score block), never the full matrix. Results per
    layer: `results[i]` = [B, last, K] softmax over layer i's keys, heads averaged (or [B, H, last, K] with
    `per_head`); `row_valid[i]` = [B, last] which of those rows are real tokens (False on padding), and
    `key_valid[i]` = [B, K]. `layers` None means every attention layer.
    """

    last: int = 1
    layers: set[int] | None = None
    per_head: bool = False
    results: dict[int, torch.Tensor] = field(default_factory=dict)
    row_valid: dict[int, torch.Tensor] = field(default_factory=dict)
    chunk_valid: torch.Tensor | None = None  # set by the runner for the current chunk

    def wants(self, layer_idx) -> bool:
        return self.layers is None or layer_idx in self.layers

    def merge(self, other: AttentionProbe | None) -> AttentionProbe:
        """One probe recording for both: every recorded layer is forwarded to both originals, each cut to
        the rows (and head averaging) it asked for, so each method keeps reading its own `results`."""
        if other is None:
            return self
        layers = None if self.layers is None or other.layers is None else self.layers | other.layers
        merged = AttentionProbe(max(self.last, other.last), layers, self.per_head or other.per_head)
        merged.results = _Fanout("results", [self, other])
        merged.row_valid = _Fanout("row_valid", [self, other])
        return merged


class _Fanout(dict):
    def __init__(self, kind: str, targets: list[AttentionProbe]):
        super().__init__()
        self.kind = kind
        self.targets = targets

    def __setitem__(self, layer, value):
        super().__setitem__(layer, value)
        for t in self.targets:
            if not t.wants(layer):
                continue
            if self.kind == "row_valid":
                t.row_valid[layer] = value[:, -t.last :]
                continue
            v = value[..., -t.last :, :]  # rows are independent softmaxes: the last n of more rows are exact
            if v.dim() == 4 and not t.per_head:
                v = v.mean(1)
            t.results[layer] = v


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


def _grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    b, h, q, d = query.shape
    return query.reshape(b, n_kv, (h // n_kv) * q, d)


def _expand_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, 1, Q, K] -> [B, 1, G*Q, K] in the same order as _grouped (group-major, then query)
    b, one, q, k = mask.shape
    return mask[:, :, None].expand(b, one, groups, q, k).reshape(b, one, groups * q, k)


def _scores(query, key, scaling):
    """The probe's extra score rows: a method's own work, counted as method FLOPs."""
    n_kv = key.shape[1]
    return matmul(_grouped(query, n_kv), key.transpose(-1, -2)) * scaling


def _record_probe(probe: AttentionProbe, layer_idx, query, key, mask, scaling):
    b, h, q, d = query.shape
    n = min(probe.last, q)
    if mask is None:  # a plain causal chunk over no past
        mask = torch.ones(q, key.shape[2], dtype=torch.bool, device=query.device).tril()[None, None]
    m_rows = mask[:, :, q - n :, :]
    s = _scores(query[:, :, q - n :], key, scaling).float()
    g = h // key.shape[1]
    s = s.masked_fill(~_expand_mask(m_rows, g), float("-inf"))
    p = torch.softmax(s, dim=-1).reshape(b, h, n, -1)
    probe.results[layer_idx] = p if probe.per_head else p.mean(1)
    if probe.chunk_valid is not None:
        probe.row_valid[layer_idx] = probe.chunk_valid[:, q - n :]


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
        _record_probe(ctx.probe, layer_idx, query, key, attention_mask, scaling)
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
    # shared parts + own keys: one exact softmax over all of them, computed part by part with each part's
    # log-sum-exp and merged; a shared part is never copied per branch
    b, h, q, d = query.shape
    n_kv = key.shape[1]
    outs = []  # (out [B, H, Q, d], lse [B, H, Q]) per part
    for part in ctx.layer_parts(layer_idx):
        kv = part.layers[layer_idx]
        outs.append(_shared_part(query, kv, part.owner, scaling))
    if ctx.tree is not None:  # each chain's ancestors, whose keys this same call computed
        anc = ctx.tree.ancestor_valid
        if anc.shape[1]:
            ka, va = _ancestor_kv(key, ctx.tree.ancestors), _ancestor_kv(value, ctx.tree.ancestors)
            o, lse = _attend(_grouped(query, n_kv), ka, va, anc[:, None, None, :], scaling)
            o, lse = _ungrouped(o, h), lse.reshape(b, h, q)
            lse = lse.masked_fill(~anc.any(1)[:, None, None], float("-inf"))  # chains without ancestors
            outs.append((o, lse))
    g = h // n_kv
    own = _attend(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), attention_mask, scaling)
    outs.append(own)
    lse_all = torch.logsumexp(torch.stack([lse for _, lse in outs]), dim=0)
    # a part a row cannot see (lse = -inf) adds nothing, whatever its kernel left in that row
    out = sum(
        torch.where(torch.isfinite(lse)[..., None], o.float(), 0.0) * torch.exp(lse - lse_all)[..., None]
        for o, lse in outs
    )
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _attend(query, key, value, mask, scaling):
    """(softmax(q k^T * scaling, masked) v, its log-sum-exp) for one part: [B, H, Q, d], [B, H, Q]. `mask`
    is bool, broadcastable to [B, 1, Q, K]; every row must see at least one key (callers mask the rest)."""
    add = None
    if mask is not None:
        add = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, float("-inf")
        )
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=add, scale=scaling
        )
        return out, lse.float()
    s = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if add is not None:
        s = s + add.float()
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(value.dtype), value), lse


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
    axis of one call against that row's keys (no per-branch copy of the part)."""
    b, h, q, d = query.shape
    n_kv = kv.key.shape[1]
    grouped = _grouped(query, n_kv)  # [B, Hk, G*Q, d]
    outs, lses = [], []
    for a, e, o in owner_runs(owner) if kv.key.shape[0] > 1 else [(0, b, 0)]:
        n = e - a
        qf = grouped[a:e].transpose(0, 1).reshape(1, n_kv, n * grouped.shape[2], d)
        mask = kv.valid[o][None, None, None, :]
        out, lse = _attend(qf, kv.key[o : o + 1], kv.value[o : o + 1], mask, scaling)
        outs.append(out.reshape(n_kv, n, -1, d).transpose(0, 1))
        lses.append(lse.reshape(n_kv, n, -1).transpose(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses) if len(lses) > 1 else lses[0]
    return _ungrouped(out, h), lse.reshape(b, h, q)


AttentionInterface.register(NAME, trimvlm_attention)


_SELECT_LOCK = threading.Lock()
_SELECTED: dict[int, list] = {}  # id(config) -> [config, implementation saved by the first entrant, runs]


@contextlib.contextmanager
def use_trimvlm_attention(configs):
    """Select trimvlm's attention on these configs for the duration of a run, then restore them.

    Safe when runs overlap (threads sharing a model, or models sharing configs): each config counts the runs
    inside; the first one in saves its implementation and selects trimvlm's, the last one out restores it."""
    configs = list({id(c): c for c in configs}.values())
    with _SELECT_LOCK:
        saved = {id(c): c._attn_implementation for c in configs if id(c) not in _SELECTED}  # before any set
        for c in configs:
            _SELECTED.setdefault(id(c), [c, saved.get(id(c)), 0])[2] += 1
            c._attn_implementation = NAME
    try:
        yield
    finally:
        with _SELECT_LOCK:
            for c in configs:
                entry = _SELECTED[id(c)]
                entry[2] -= 1
                if entry[2] == 0:
                    del _SELECTED[id(c)]
                    c._attn_implementation = entry[1]
            for c, _, _ in _SELECTED.values():  # a restore reaches sub-configs; keep the held ones selected
                c._attn_implementation = NAME
