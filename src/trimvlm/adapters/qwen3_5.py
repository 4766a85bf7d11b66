"""Qwen3.5: the Qwen-VL front end (M-RoPE, vision tower without deepstack) over a hybrid text stack of
Gated DeltaNet (linear attention) layers and gated full-attention layers.

Padding in the recurrent layers. The model zeroes padded positions before a Gated DeltaNet layer (its 2-D
padding mask, `create_recurrent_attention_mask`). For left padding over a fresh state that is exact: zero inputs
give zero conv outputs, so zero keys and values, and a zero state stays zero however much it decays; the real
tokens then see the same zero left context as an unpadded run. Anywhere else a zeroed position is *not* absent:
inside the sequence the causal conv of the next tokens reads its zeros instead of the real tokens before it,
its own conv output is not zero, and every position decays the state. trimvlm's meaning of an invalid
position is "absent" (as it is for attention layers), so a linear layer here
- moves each row's valid tokens to the right end, in order (left-padded form), and back afterwards;
- on a fresh state (prefill) runs the batch with the 2-D mask, exactly what the model does with left padding;
- continuing from a cached state with padding in the chunk (branches or steps of different lengths), runs each
  group of rows that has the same number of valid tokens on those tokens only, from the rows' states, so padding
  neither decays a state nor enters a conv window.
Dropping tokens mid-model (gather) and masking them (valid = False) therefore give the same states and logits.

Short segments (at most `recurrent_max_len` tokens: decode steps, candidate suffixes, trie chains) run the
gated delta rule's recurrent form at their own length (`kernels.gated_delta`, `_linear_steps`) instead of the
chunked kernel, which pads every call to 64 tokens. There all rows run in one call: valid tokens first, absent
positions leave the state unchanged, each row's conv state is taken after its own last valid token, and rows
start from their prefix's states by index.

Branches (candidate scoring) read the prefix's states as read-only broadcast views: rows that start from
different prefixes run in separate calls, so no per-branch copy of a prefix state is made. A candidate tree
(`cache.tree`, a `TreeSchedule`) cannot go through a recurrent scan as one sequence: its chains run as the
schedule's calls, each row from its parent chain's final state (or the prefix's), and only chains with children
keep their final states.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from trimvlm.adapters.base import Adapter
from trimvlm.adapters.qwen3_vl import QwenVLAdapterMixin
from trimvlm.kernels.gated_delta import gated_delta_steps
from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.layers import LINEAR


class Qwen35Adapter(QwenVLAdapterMixin, Adapter):
    family = "qwen3_5"
    recurrent_chunk = 64  # transformers' chunked gated-delta kernel pads every row to 64-token chunks
    # segments of at most this many tokens (decode steps, candidate suffixes, tree chains) run the recurrent
    # form at their own length instead of the chunked kernel (measured: docs/scoring.md, "Recurrent branches");
    # 0 runs every segment through transformers' chunked kernel
    recurrent_max_len = 24

    def __init__(self, model, tokenizer, image_processor, folder=None):
        super().__init__(model, _as_saved(tokenizer, folder), image_processor, folder=folder)

    def run_layer(self, i, hidden, position_embeddings, mask, cache, ctx, pad_mask2d=None):
        if self.layer_types[i] != LINEAR:
            return super().run_layer(i, hidden, position_embeddings, mask, cache, ctx, pad_mask2d)
        return self._run_linear(i, hidden, position_embeddings, cache, pad_mask2d)

    def _call(self, i, hidden, position_embeddings, cache, mask2d=None):
        return self.layers[i](
            hidden, position_embeddings=position_embeddings, attention_mask=mask2d, cache=cache
        )

    def _run_linear(self, i, hidden, position_embeddings, cache, valid):
        if cache is not None and cache.tree is not None:
            return self._run_tree_linear(i, hidden, cache)
        if hidden.shape[1] <= self.recurrent_max_len:
            return self._run_linear_steps(i, hidden, cache, valid)
        groups = None if cache is None else cache.state_groups(i)
        one_group = groups is None or bool((groups == groups[0]).all())
        if (valid is None or bool(valid.all())) and one_group:
            return self._call(i, hidden, position_embeddings, cache)
        b, q = hidden.shape[:2]
        valid = torch.ones(b, q, dtype=torch.bool, device=hidden.device) if valid is None else valid
        n = valid.sum(1)
        left = torch.arange(q, device=valid.device)[None] >= (q - n)[:, None]  # valid tokens at the right end
        order = None
        if not torch.equal(valid, left):
            # stable sort: invalid positions first, valid ones after them in their order
            order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices
            hidden = hidden.gather(1, order[..., None].expand_as(hidden))
        if cache is None or not cache.has_state(i):  # a fresh state: what the model does with left padding
            out = self._call(i, hidden, position_embeddings, cache, left.to(torch.long))
        else:
            out = hidden.clone()  # rows' invalid positions keep their input (never read)
            # rows with the same count of valid tokens (and the same shared start state) run together
            # (every group's start states are taken before any group's final states are written back)
            key = n if groups is None else n * (int(groups.max()) + 1) + groups
            sels = [torch.nonzero(key == k).flatten() for k in key.unique().tolist()]
            runs = [(sel, int(n[sel[0]]), cache.layer_rows(i, sel)) for sel in sels if int(n[sel[0]]) > 0]
            for sel, m, sub in runs:
                out[sel, q - m :] = self._call(i, hidden[sel, q - m :], position_embeddings, sub)
            for sel, _, sub in runs:
                cache.put_layer_rows(i, sel, sub)
        if order is not None:
            out = out.scatter(1, order[..., None].expand_as(out), out)  # each token back to its place
        return out

    def _run_tree_linear(self, i, hidden, cache):
        """Run the schedule's chains (flat node indices into [B * M]) in dependency order."""
        b, m, d = hidden.shape
        flat = hidden.reshape(b * m, d)
        out = flat.clone()  # padding nodes keep their input (never read)
        finals: dict[int, dict[str, torch.Tensor]] = {}  # chain id -> its final states (one row each)
        for call in cache.tree.calls:
            x = flat[call.nodes.clamp(min=0)]
            real = call.nodes >= 0
            table, rows = _start(i, call, cache, finals)
            if x.shape[1] <= self.recurrent_max_len:  # padding after a chain's end: absent, not run
                y, states = self._linear_steps(i, x, real, table, rows)
            else:
                sub = KVCache.branching(
                    [], {i: table}, rows, keep_final_states=call.keep, num_layers=cache.num_layers
                )  # fmt: skip
                y = self._call(i, x, None, sub)
                states = sub.states.get(i, {})
            out[call.nodes[real]] = y[real]
            if call.keep:
                for r, chain in enumerate(call.chain.tolist()):
                    finals[chain] = {k: v[r : r + 1] for k, v in states.items()}
        return out.view(b, m, d)

    def _run_linear_steps(self, i, hidden, cache, valid):
        """A short segment through the recurrent form: each row's valid tokens moved to the front (in order),
        the rest absent, every row from its own start state in one call, whatever its count of valid tokens."""
        table, rows = ({}, None) if cache is None else cache.start_states(i)
        order = None
        if valid is not None and not bool(valid.all()):
            order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid first, in order
            hidden, valid = hidden.gather(1, order[..., None].expand_as(hidden)), valid.gather(1, order)
        else:
            valid = None
        out, states = self._linear_steps(i, hidden, valid, table, rows)
        if cache is not None:
            cache.set_states(i, states)
        if order is not None:
            out = out.scatter(1, order[..., None].expand_as(out), out)  # each token back to its place
        return out

    def _linear_steps(self, i, x, valid, table, rows):
        """Decoder layer i (a Gated DeltaNet layer) over x [B, T, D] in the recurrent form (`kernels.gated_delta`),
        the module's own sub-modules computing everything around the recurrence in the order of transformers'
        layer. `valid` [B, T] (None: all) holds each row's valid tokens first; rows start from `table` (conv /
        recurrent states, {}: fresh) rows `rows` (None: row b from row b). Returns (output, final states)."""
        layer = self.layers[i]
        gdn = layer.linear_attn
        h = layer.input_layernorm(x)
        b, t, _ = h.shape
        mixed = gdn.in_proj_qkv(h).transpose(1, 2)  # [B, C, T], the conv's input channels
        kernel = gdn.conv_kernel_size
        conv0 = table.get("conv")
        if conv0 is None:
            left = mixed.new_zeros(b, mixed.shape[1], kernel)
        else:
            left = conv0.to(mixed.dtype)
            left = left.index_select(0, rows) if rows is not None else left
        full = torch.cat([left.expand(b, -1, -1), mixed], dim=-1)  # [B, C, kernel + T]
        w = gdn.conv1d.weight
        conv = F.conv1d(full.to(w.dtype), w, gdn.conv1d.bias, groups=full.shape[1])[..., 1:]  # [B, C, T]
        conv = ACT2FN[gdn.activation](conv).to(mixed.dtype).transpose(1, 2)
        if valid is None:
            conv_final = full[..., -kernel:].clone(memory_format=torch.contiguous_format)
        else:  # each row's last `kernel` inputs end after its own valid tokens
            at = valid.sum(1)[:, None] + torch.arange(kernel, device=x.device)[None]  # [B, kernel]
            conv_final = full.gather(2, at[:, None].expand(-1, full.shape[1], -1))
        q, k, v = torch.split(conv, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        q = q.reshape(b, t, -1, gdn.head_k_dim)
        k = k.reshape(b, t, -1, gdn.head_k_dim)
        v = v.reshape(b, t, -1, gdn.head_v_dim)
        beta = gdn.in_proj_b(h).sigmoid()
        g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(h).float() + gdn.dt_bias)
        core, rec = gated_delta_steps(q, k, v, g, beta, state=table.get("recurrent"), rows=rows, valid=valid)
        z = gdn.in_proj_z(h).reshape(-1, gdn.head_v_dim)
        core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z).reshape(b, t, -1)
        x = x + gdn.out_proj(core)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, {"conv": conv_final, "recurrent": rec}

    def linear_layer_core_flops(self, i: int, batch: int, q: int) -> int:
        # Gated delta rule, counted in its recurrent form per token and per value head h, with the state
        # S_h of size d_k x d_v: read the old memory k^T S (d_k d_v MACs), write the rank-1 correction
        # S += k (beta (v - k^T S))^T (d_k d_v MACs), read out q^T S (d_k d_v MACs): 3 d_k d_v MACs (the decay
        # exp(g) S is element-wise, not counted). Plus the depthwise causal conv over the q, k, v channels:
        # conv_dim * kernel MACs per token. FLOPs = 2 per MAC:
        #   2 * batch * q * (3 * H_v * d_k * d_v + (2 * H_k * d_k + H_v * d_v) * kernel)
        # (The chunked kernel spends the same order of work; this counts the algorithm, not one kernel.)
        cfg = self.text_config
        h_k, h_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        d_k, d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * h_k * d_k + h_v * d_v
        return 2 * batch * q * (3 * h_v * d_k * d_v + conv_dim * cfg.linear_conv_kernel_dim)


def _start(i, call, cache, finals) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the table of start states of a call's rows, the table row each reads): the prefix's own tensors (rows =
    requests) when the chains hang off the prefix, else one row per distinct parent chain."""
    if bool((call.parent < 0).all()):
        return cache.prefix.states[i], call.owner
    if bool((call.parent < 0).any()):
        raise ValueError("a tree call mixes chains that start at the prefix and chains that continue others")
    parents = call.parent.unique()
    table = {k: torch.cat([finals[p][k] for p in parents.tolist()]) for k in finals[int(parents[0])]}
    return table, torch.searchsorted(parents, call.parent)


def _as_saved(tokenizer, folder):
    """transformers' AutoTokenizer builds its byte-level BPE `Qwen3_5Tokenizer` for every `qwen3_5` checkpoint,
    whatever `tokenizer_config.json` names, from the saved vocabulary. A checkpoint whose `tokenizer.json` holds
    another model (the word-level tokenizers of the tiny and demo checkpoints) then tokenizes wrongly (a word
    becomes bytes without merges). Such a tokenizer is reloaded as saved."""
    if folder is None or not (folder / "tokenizer.json").exists():
        return tokenizer
    try:
        kind = json.loads((folder / "tokenizer.json").read_text())["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return tokenizer
    if kind == "BPE":
        return tokenizer
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder)
