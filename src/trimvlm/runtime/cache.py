"""trimvlm's KV cache: per layer its own length, validity and provenance, so that layers can shrink.

It implements the one method transformers' attention modules call, `update(key, value, layer_idx, **kw)`, and
for Gated DeltaNet layers the conv/recurrent state accessors. Entries are physically removed by `gather`; a
batch of branches can read a shared prefix (`share_prefix`) without copying it (the attention function reads the
prefix from here and merges the two parts by log-sum-exp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.runtime.sequence import compact_order


@dataclass
class LayerKV:
    key: torch.Tensor  # [B, Hk, K, hd]
    value: torch.Tensor
    valid: torch.Tensor  # [B, K] bool
    visual: torch.Tensor  # [B, K] bool
    source: torch.Tensor  # [B, K] long (original prefill index, or -1 for padding / generated tokens)


@dataclass
class SharedPrefix:
    """A read-only prefix cache that `batch` branches attend to; `owner[b]` is the prefix row of branch b."""

    layers: dict[int, LayerKV]
    states: dict[int, dict[str, torch.Tensor]]
    owner: torch.Tensor  # [B] long


class KVCache:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.layers: dict[int, LayerKV] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}  # recurrent layers: conv / recurrent
        self.prefix: SharedPrefix | None = None
        self._pending = None  # the chunk being written: (valid, visual, source) [B, Q]
        self._meta_memo: dict[tuple[int, str], torch.Tensor] = {}
        self._recording = False

    # ---- the runner's side ----
    def begin_chunk(self, valid: torch.Tensor, visual: torch.Tensor, source: torch.Tensor) -> None:
        self._pending = (valid, visual, source)
        self._meta_memo = {}

    def past_valid(self, layer_idx: int) -> torch.Tensor | None:
        entry = self.layers.get(layer_idx)
        return None if entry is None else entry.valid

    def length(self, layer_idx: int) -> int:
        entry = self.layers.get(layer_idx)
        return 0 if entry is None else entry.key.shape[2]

    # ---- transformers' attention modules call this ----
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        valid, visual, source = self._pending
        entry = self.layers.get(layer_idx)
        if entry is None:
            self.layers[layer_idx] = LayerKV(key_states, value_states, valid, visual, source)
        else:
            entry.key = torch.cat([entry.key, key_states], dim=2)
            entry.value = torch.cat([entry.value, value_states], dim=2)
            entry.valid = self._cat_meta("valid", entry.valid, valid)
            entry.visual = self._cat_meta("visual", entry.visual, visual)
            entry.source = self._cat_meta("source", entry.source, source)
        entry = self.layers[layer_idx]
        return entry.key, entry.value

    def _cat_meta(self, name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        # layers that shared one metadata tensor keep sharing the concatenated one
        key = (id(old), name)
        if key not in self._meta_memo:
            self._meta_memo[key] = torch.cat([old, new], dim=1)
        return self._meta_memo[key]

    # ---- Gated DeltaNet (linear attention) state accessors, as transformers' hybrid caches name them ----
    def get_conv_state(self, layer_idx, state_idx=0):
        return self.states.get(layer_idx, {}).get("conv")

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.states.get(layer_idx, {}).get("recurrent")

    def update_conv_state(self, new_conv_state, layer_idx, *args, conv_kernel_size=None, **kwargs):
        """`new_conv_state` [B, C, Q] holds the chunk's conv inputs. Returns them with the cached left context
        prepended (the previous `conv_kernel_size` inputs; zeros on the first chunk when it is shorter than the
        kernel), the causal conv's input; keeps the last `conv_kernel_size` inputs as the new state, in a new
        tensor. (The model's single-token decode instead writes the held conv state in place; a branch cache holds
        its own copies of the prefix states, so a prefix is never changed.)"""
        st = self.states.setdefault(layer_idx, {})
        old = st.get("conv")
        if old is None:
            full = new_conv_state
            if conv_kernel_size is not None and full.shape[-1] < conv_kernel_size:
                full = torch.nn.functional.pad(full, (conv_kernel_size - full.shape[-1], 0))
        else:
            full = torch.cat([old.to(new_conv_state.dtype), new_conv_state], dim=-1)
        keep = conv_kernel_size if conv_kernel_size is not None else full.shape[-1]
        st["conv"] = full[..., -keep:].clone(memory_format=torch.contiguous_format)
        return full

    def update_recurrent_state(self, new_state, layer_idx, *args, **kwargs):
        self.states.setdefault(layer_idx, {})["recurrent"] = new_state
        return new_state

    def is_recording_past(self, layer_idx) -> bool:
        return self._recording

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        if layer_idx is None:
            return bool(self.states) and all(st.get("recurrent") is not None for st in self.states.values())
        return self.states.get(layer_idx, {}).get("recurrent") is not None

    def state_rows(self, layer_idx: int, rows: torch.Tensor) -> KVCache:
        """A cache holding copies of rows `rows` of one recurrent layer's states, to run a subset of the batch
        (rows whose chunks hold different numbers of valid tokens); write back with `put_state_rows`."""
        sub = KVCache(self.num_layers)
        sub.states[layer_idx] = {
            k: v.index_select(0, rows) for k, v in self.states.get(layer_idx, {}).items() if v is not None
        }
        return sub

    def put_state_rows(self, layer_idx: int, rows: torch.Tensor, sub: KVCache) -> None:
        """Take rows `rows` of one recurrent layer's states from `sub` (out of place: new tensors)."""
        st = self.states.setdefault(layer_idx, {})
        for k, v in sub.states.get(layer_idx, {}).items():
            old = st.get(k)
            if old is None:
                batch = self._pending[0].shape[0]
                old = torch.zeros((batch, *v.shape[1:]), dtype=v.dtype, device=v.device)
            st[k] = old.index_copy(0, rows, v.to(old.dtype))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length(layer_idx)

    # ---- cache operations ----
    def gather(self, layer_idx: int, keep: torch.Tensor) -> None:
        """Physically keep entries where `keep` [B, K] is True (compacted right, order kept) in one layer."""
        entry = self.layers[layer_idx]
        keep = keep & entry.valid
        order = compact_order(keep)
        b = torch.arange(order.shape[0], device=order.device)[:, None]
        idx = order[:, None, :, None].expand(-1, entry.key.shape[1], -1, entry.key.shape[3])
        new_valid = keep.gather(1, order)
        self.layers[layer_idx] = LayerKV(
            key=entry.key.gather(2, idx).contiguous(),
            value=entry.value.gather(2, idx).contiguous(),
            valid=new_valid,
            visual=entry.visual[b, order] & new_valid,
            source=entry.source[b, order].masked_fill(~new_valid, -1),
        )

    def share_prefix(self, owner: torch.Tensor) -> KVCache:
        """A new cache for len(owner) branches that reads this cache as a shared, uncopied prefix."""
        branch = KVCache(self.num_layers)
        branch.prefix = SharedPrefix(layers=self.layers, states=self.states, owner=owner)
        # recurrent layers start each branch from the prefix state: the branch gets a read-only view and
        # writes its own working state on first update (the prefix's tensors are never written).
        for layer_idx, st in self.states.items():
            branch.states[layer_idx] = {k: v.index_select(0, owner) for k, v in st.items()}
        return branch

    # ---- accounting ----
    def attention_bytes(self) -> int:
        own = sum(e.key.nbytes + e.value.nbytes for e in self.layers.values())
        if self.prefix is not None:
            own += sum(e.key.nbytes + e.value.nbytes for e in self.prefix.layers.values())
        return own

    def state_bytes(self) -> int:
        return sum(t.nbytes for st in self.states.values() for t in st.values() if t is not None)
