"""trimvlm's KV cache: per layer its own length, validity and provenance, so that layers can shrink.

It implements the one method transformers' attention modules call, `update(key, value, layer_idx, **kw)`, and
for Gated DeltaNet layers the conv/recurrent state accessors. Entries are physically removed by `gather`; a
batch of branches can read a shared prefix (`share_prefix`) without copying it (the attention function reads the
prefix from here and merges the two parts by log-sum-exp).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from trimvlm.runtime.sequence import LiveSeq, compact_order

# what pads each field of a `LayerKV` (a padded column is invalid, never attended)
FILL = {"key": 0, "value": 0, "valid": False, "visual": False, "source": -1}


def column_dim(t: torch.Tensor) -> int:
    """The entries' axis of a `LayerKV` field: 2 for key / value [B, Hk, K, hd], 1 for the metadata [B, K]."""
    return 2 if t.dim() == 4 else 1


def padded_cat(parts: list[torch.Tensor], fill, dim: int, batch: int = 0) -> torch.Tensor:
    """`parts` concatenated along axis `batch`, each left-padded with `fill` to the widest along axis `dim`: one
    copy per part."""
    width = max(t.shape[dim] for t in parts)
    shape = list(parts[0].shape)
    shape[batch], shape[dim] = sum(t.shape[batch] for t in parts), width
    out = torch.full(shape, fill, dtype=parts[0].dtype, device=parts[0].device)
    at = 0
    for t in parts:
        out.narrow(batch, at, t.shape[batch]).narrow(dim, width - t.shape[dim], t.shape[dim]).copy_(t)
        at += t.shape[batch]
    return out


@dataclass
class LayerKV:
    key: torch.Tensor  # [B, Hk, K, hd]
    value: torch.Tensor
    valid: torch.Tensor  # [B, K] bool
    visual: torch.Tensor  # [B, K] bool
    source: torch.Tensor  # [B, K] long (original prefill index, or -1 for padding / generated tokens)

    def map(self, fn) -> LayerKV:
        """`fn(name, tensor)` over every field."""
        return LayerKV(**{n: fn(n, getattr(self, n)) for n in FILL})

    def rows(self, rows: torch.Tensor) -> LayerKV:
        return self.map(lambda _, t: t.index_select(0, rows))


def state_rows(states: dict[int, dict[str, torch.Tensor]], rows: torch.Tensor) -> dict:
    """Rows `rows` of recurrent states (per layer, per name; copies)."""
    return {i: {k: v.index_select(0, rows) for k, v in st.items() if v is not None} for i, st in states.items()}


@dataclass
class SharedPart:
    """Read-only attention KV that a batch of branches attends to: branch b reads row `owner[b]`."""

    layers: dict[int, LayerKV]
    owner: torch.Tensor  # [B] long


@dataclass
class SharedPrefix:
    """What a batch of branches reads and never writes: one or more KV parts, attended in order before the
    branch's own keys (a request's prefix, then e.g. the path of a parent trie segment), and the recurrent
    states every branch starts from (`states`, branch b reading row `state_owner[b]`)."""

    parts: list[SharedPart]
    states: dict[int, dict[str, torch.Tensor]]
    state_owner: torch.Tensor  # [B] long

    def rows(self, rows: torch.Tensor) -> SharedPrefix:
        """What batch rows `rows` read of it: the same tensors, read by those rows' owners."""
        parts = [SharedPart(p.layers, p.owner.index_select(0, rows)) for p in self.parts]
        return SharedPrefix(parts, self.states, self.state_owner.index_select(0, rows))


class RowRun(NamedTuple):
    """A maximal run of batch rows [start, end) that read one row of a shared part."""

    start: int
    end: int
    row: int | list[int]


def owner_runs(owner: torch.Tensor) -> list[RowRun]:
    """Each maximal run of equal entries of `owner` [B] (of equal rows of `owner` [B, N]: `row` is a list)."""
    dim = 0 if owner.dim() > 1 else None
    vals, counts = (t.tolist() for t in torch.unique_consecutive(owner, return_counts=True, dim=dim))
    ends = list(itertools.accumulate(counts))
    return [RowRun(e - n, e, v) for v, n, e in zip(vals, counts, ends, strict=True)]


def shared_rows(t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Rows `owner` of `t`: a broadcast view (no copy) when every branch reads the same row; a copy only when
    one call holds branches of different rows (callers group rows by owner to avoid it)."""
    first = int(owner[0])
    if bool((owner == first).all()):
        return t[first : first + 1].expand(len(owner), *t.shape[1:])
    return t.index_select(0, owner)


class KVCache:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.layers: dict[int, LayerKV] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}  # recurrent layers: conv / recurrent
        self.prefix: SharedPrefix | None = None
        self._pending = None  # the chunk being written: (valid, visual, source) [B, Q]
        self._meta_memo: dict[tuple[int, str], torch.Tensor] = {}
        # False for leaf branches: their final conv/recurrent states have no reader, so they are never stored
        self.keep_final_states = True
        # a TreeSchedule when the chunk is a candidate tree (recurrent layers run its chains)
        self.tree = None
        self.keep_kv = True  # False for leaf branches: their own keys/values have no later reader

    # ---- the runner's side ----
    def begin_chunk(self, valid: torch.Tensor, visual: torch.Tensor, source: torch.Tensor) -> None:
        self._pending = (valid, visual, source)
        self._meta_memo = {}

    def past_valid(self, layer_idx: int) -> torch.Tensor | None:
        entry = self.layers.get(layer_idx)
        return None if entry is None else entry.valid

    def length(self, layer_idx: int = 0) -> int:
        entry = self.layers.get(layer_idx)
        return 0 if entry is None else entry.key.shape[2]

    get_seq_length = length  # transformers' name

    # ---- transformers' attention modules call this ----
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.keep_kv:
            return key_states, value_states
        valid, visual, source = self._pending
        entry = self.layers.get(layer_idx)
        new = LayerKV(key_states, value_states, valid, visual, source)
        if entry is not None:
            new = entry.map(lambda n, t: self._cat(n, t, getattr(new, n)))
        self.layers[layer_idx] = new
        return new.key, new.value

    def _cat(self, name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if name in ("key", "value"):
            return torch.cat([old, new], dim=2)
        # layers that shared one metadata tensor keep sharing the concatenated one
        key = (id(old), name)
        if key not in self._meta_memo:
            self._meta_memo[key] = torch.cat([old, new], dim=1)
        return self._meta_memo[key]

    # ---- Gated DeltaNet (linear attention) state accessors, as transformers' hybrid caches name them ----
    def _state(self, layer_idx, name):
        own = self.states.get(layer_idx, {}).get(name)
        if own is not None or self.prefix is None:
            return own
        shared = self.prefix.states.get(layer_idx, {}).get(name)
        return None if shared is None else shared_rows(shared, self.prefix.state_owner)

    def get_conv_state(self, layer_idx, state_idx=0):
        return self._state(layer_idx, "conv")

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self._state(layer_idx, "recurrent")

    def update_conv_state(self, new_conv_state, layer_idx, *args, conv_kernel_size=None, **kwargs):
        """`new_conv_state` [B, C, Q] holds the chunk's conv inputs. Returns the causal conv's input: them with
        the cached left context prepended (zeros on a first chunk shorter than the kernel); keeps the last
        `conv_kernel_size` inputs as the new state, in a new tensor (a prefix's state is never changed)."""
        old = self.get_conv_state(layer_idx)
        if old is None:
            full = new_conv_state
            if conv_kernel_size is not None and full.shape[-1] < conv_kernel_size:
                full = torch.nn.functional.pad(full, (conv_kernel_size - full.shape[-1], 0))
        else:
            full = torch.cat([old.to(new_conv_state.dtype), new_conv_state], dim=-1)
        if self.keep_final_states:
            keep = conv_kernel_size if conv_kernel_size is not None else full.shape[-1]
            st = self.states.setdefault(layer_idx, {})
            st["conv"] = full[..., -keep:].clone(memory_format=torch.contiguous_format)
        return full

    def update_recurrent_state(self, new_state, layer_idx, *args, **kwargs):
        if self.keep_final_states:
            self.states.setdefault(layer_idx, {})["recurrent"] = new_state
        return new_state

    def start_states(self, layer_idx: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """What a recurrent layer's rows start from, nothing copied: a table of states and the table row each
        batch row reads (None: row b reads row b): the layer's own states, or the shared prefix's read by
        `state_owner`; ({}, None) on a fresh state."""
        own = self.states.get(layer_idx)
        if own or self.prefix is None or not self.prefix.states.get(layer_idx):
            return dict(own or {}), None
        return self.prefix.states[layer_idx], self.prefix.state_owner

    def set_states(self, layer_idx: int, states: dict[str, torch.Tensor]) -> None:
        """Store a recurrent layer's final states (new tensors, one row per batch row); leaf branches, whose
        final states have no reader, store nothing."""
        if self.keep_final_states:
            self.states[layer_idx] = dict(states)

    def is_recording_past(self, layer_idx) -> bool:
        # a branch reads shared states as broadcast views: the model's in-place single-token conv update
        # must not run on them, so branches always take the out-of-place path
        return self.prefix is not None

    def has_state(self, layer_idx: int) -> bool:
        """Whether a recurrent layer continues from a state (its own, or a shared prefix's)."""
        return bool(self.start_states(layer_idx)[0])

    def state_groups(self, layer_idx: int) -> torch.Tensor | None:
        """[B] the shared state row each branch starts from, while this layer's states are still the shared
        ones (rows of different groups must run in separate calls to stay uncopied); None otherwise."""
        if self.prefix is None or self.states.get(layer_idx):
            return None
        return self.prefix.state_owner if layer_idx in self.prefix.states else None

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

    def share_prefix(self, owner: torch.Tensor, *, keep_final_states: bool = True) -> KVCache:
        """A new cache for len(owner) branches that reads this cache as a shared, uncopied prefix: attention
        reads its KV rows `owner`, recurrent layers start from its states as read-only broadcast views (each
        branch's working state is the kernel's own output; the prefix's tensors are never written)."""
        return KVCache.branching(  # the dicts copied (this cache may change later), never the tensors
            [SharedPart(dict(self.layers), owner)], dict(self.states), owner, keep_final_states=keep_final_states,
            num_layers=self.num_layers,
        )  # fmt: skip

    @staticmethod
    def branching(parts, states, state_owner, *, keep_final_states: bool, num_layers: int) -> KVCache:
        """A branch cache over shared `parts` (attended in order) starting from shared `states`."""
        branch = KVCache(num_layers)
        branch.prefix = SharedPrefix(parts=list(parts), states=states, state_owner=state_owner)
        branch.keep_final_states = keep_final_states
        return branch

    def copy_rows(self, rows: torch.Tensor) -> KVCache:
        """An independent cache holding copies of rows `rows` (KV entries and recurrent states)."""
        out = KVCache(self.num_layers)
        out.layers = {i: e.rows(rows) for i, e in self.layers.items()}
        out.states = state_rows(self.states, rows)
        return out

    def layer_rows(self, layer_idx: int, rows: torch.Tensor) -> KVCache:
        """A cache holding rows `rows` of one layer (its KV entries or recurrent states, the chunk being written
        and the shared prefix they read), to run that layer on a subset of the batch; write back with
        `put_layer_rows`."""
        sub = KVCache(self.num_layers)
        if layer_idx in self.layers:
            sub.layers[layer_idx] = self.layers[layer_idx].rows(rows)
        if self.states.get(layer_idx):
            sub.states = state_rows({layer_idx: self.states[layer_idx]}, rows)
        if self.prefix is not None:
            sub.prefix = self.prefix.rows(rows)
        sub._pending = tuple(t.index_select(0, rows) for t in self._pending)
        sub.keep_final_states, sub.keep_kv = self.keep_final_states, self.keep_kv
        return sub

    def put_layer_rows(self, layer_idx: int, rows: torch.Tensor, sub: KVCache) -> None:
        """Take rows `rows` of one layer from `sub` (the rows that ran it). The other rows get the chunk's columns
        as invalid padding, and keep their recurrent states."""
        new, b = sub.layers.get(layer_idx), self._pending[0].shape[0]
        if new is not None:
            old = self.layers.get(layer_idx)
            q = new.key.shape[2] - (0 if old is None else old.key.shape[2])

            def widen(name, t):
                shape = [b, *t.shape[1:]]
                shape[column_dim(t)] = q
                pad = torch.full(shape, FILL[name], dtype=t.dtype, device=t.device)
                base = pad if old is None else torch.cat([getattr(old, name), pad], dim=column_dim(t))
                return base.index_copy(0, rows, t)

            self.layers[layer_idx] = new.map(widen)
        if sub.states.get(layer_idx) and self.keep_final_states:
            st = self.states.setdefault(layer_idx, {})
            for k, v in sub.states[layer_idx].items():
                old = st.get(k)
                if old is None:
                    old = torch.zeros((b, *v.shape[1:]), dtype=v.dtype, device=v.device)
                st[k] = old.index_copy(0, rows, v.to(old.dtype))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (samples that stopped leave), in place, freeing the others' entries and
        states; in each layer the columns no remaining row uses are dropped (`gather`), and layers that shared
        their metadata share it again."""
        metas: dict[tuple, LayerKV] = {}
        for i, e in list(self.layers.items()):
            self.layers[i] = e.rows(rows)
            self.gather(i, self.layers[i].valid)
            new = self.layers[i]
            m = metas.setdefault((id(e.valid), id(e.visual), id(e.source)), new)
            if m is not new and torch.equal(m.valid, new.valid) and torch.equal(m.source, new.source):
                new.valid, new.visual, new.source = m.valid, m.visual, m.source
        self.states = state_rows(self.states, rows)
        if self.prefix is not None:  # branches off a shared prefix: the rows that stay keep their owners
            p = self.prefix.rows(rows)
            p.parts = [q for q in p.parts if bool((q.owner >= 0).any())]  # a part no row reads any more is let go
            self.prefix = p if p.parts or any(p.states.values()) else None

    def join(self, other: KVCache) -> None:
        """Append the rows of `other` after this cache's rows, in place (a request admitted into a running decode
        batch). Each layer's entries are left-padded with invalid columns to the longer of the two, recurrent
        states are concatenated. Rows reading shared prefix parts keep reading them, uncopied (owner -1 for the
        other cache's rows). Shared recurrent states cannot be joined (ValueError)."""
        for c in (self, other):
            if c.prefix is not None and any(c.prefix.states.values()):
                raise ValueError("caches reading shared recurrent states cannot be joined")
        a_rows, b_rows = self.rows(), other.rows()
        parts = []
        for c, pad in ((self, (0, b_rows)), (other, (a_rows, 0))):  # rows before and after c's own
            for q in [] if c.prefix is None else c.prefix.parts:
                parts.append(SharedPart(q.layers, torch.nn.functional.pad(q.owner, pad, value=-1)))
        if parts:
            owner = parts[0].owner.new_full((a_rows + b_rows,), -1)
            self.prefix = SharedPrefix(parts, {}, owner)
        memo: dict[tuple, torch.Tensor] = {}

        def cat(name, x, y):
            key = (name, id(x), id(y))
            if key not in memo:  # a layer one side never ran is padding there: no columns of its own
                x = _no_columns(y, a_rows) if x is None else x
                y = _no_columns(x, b_rows) if y is None else y
                memo[key] = padded_cat([x, y], FILL[name], column_dim(x))
            return memo[key]

        for i in sorted(set(self.layers) | set(other.layers)):
            a, b = self.layers.get(i), other.layers.get(i)
            self.layers[i] = LayerKV(**{n: cat(n, getattr(a, n, None), getattr(b, n, None)) for n in FILL})
        for i in set(self.states) | set(other.states):
            a, b = self.states.get(i, {}), other.states.get(i, {})
            if set(a) != set(b):
                raise ValueError(f"layer {i}: recurrent states {sorted(a)} and {sorted(b)} cannot be joined")
            self.states[i] = {k: torch.cat([a[k], b[k].to(a[k].dtype)], dim=0) for k in a}

    def rows(self) -> int:
        """Batch rows this cache holds."""
        for e in self.layers.values():
            return e.key.shape[0]
        for st in self.states.values():
            for t in st.values():
                return t.shape[0]
        return 0 if self.prefix is None else int(self.prefix.state_owner.shape[0])  # branches yet to write

    # ---- accounting ----
    def attention_bytes(self) -> int:
        own = sum(e.key.nbytes + e.value.nbytes for e in self.layers.values())
        if self.prefix is not None:
            own += sum(e.key.nbytes + e.value.nbytes for p in self.prefix.parts for e in p.layers.values())
        return own

    def state_bytes(self) -> int:
        return sum(t.nbytes for st in self.states.values() for t in st.values() if t is not None)


def _no_columns(like: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows shaped like `like`, with no entries."""
    shape = [rows, *like.shape[1:]]
    shape[column_dim(like)] = 0
    return like.new_empty(shape)


@dataclass
class PrefillOutput:
    """What a prefill hands the decode: logits, the live sequence after the last layer, its cache, positions."""

    logits: torch.Tensor | None  # [B, V] at each sample's last token, [B, S, V] with all_logits, None without
    seq: LiveSeq  # the live sequence after the last layer (hidden = final-normed states)
    cache: KVCache
    next_pos: torch.Tensor  # [B] position id of the next token (original, never the shrunk length)
