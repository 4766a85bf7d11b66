"""A store bounded in bytes that evicts the least recently used entries first: what the cross-request caches
(vision features, System One prefixes) keep their entries in. An entry larger than the bound is not stored.
`stats()` says what it holds and how often it was asked for."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch
from torch.utils._pytree import tree_flatten

from trimvlm.errors import InputError
from trimvlm.runtime.tensor_memo import remembered

MEMO_BYTES = 1 << 16  # a tensor this large is hashed once while it lives unchanged (`tensor_memo.remembered`)


def digest(*parts) -> bytes:
    """A 128-bit key over strings, ints and tensors (a tensor by its dtype, shape and bytes). The digest of a
    large tensor's bytes is remembered for that very tensor until it is freed or written in place: a request
    found in the request cache brings the same pixel tensors back, and its prefix key is then not hashed over
    its images' pixels again."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(f"{p.dtype}{tuple(p.shape)}".encode())
            large = p.nbytes >= MEMO_BYTES
            h.update(remembered("digest", [p], lambda p=p: _blake(p)) if large else _bytes(p))
        else:
            h.update(repr(p).encode())
        h.update(b"\x00")
    return h.digest()


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _blake(t: torch.Tensor) -> bytes:
    return hashlib.blake2b(_bytes(t), digest_size=16).digest()


def nbytes(value) -> int:
    """Bytes of the tensors in a value (tensors, and tuples / lists / dicts of them)."""
    return sum(t.nbytes for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class ByteLRU:
    def __init__(self, max_bytes: int, name: str = "cache"):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise InputError(f"the {name} bound must be a positive number of bytes, got {max_bytes!r}")
        self.name = name
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()  # the model thread writes, a metrics reader reads
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.too_large = 0

    def get(self, key: bytes):
        """The value stored under `key` (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: bytes, value, size: int | None = None) -> None:
        """Store `value` (`size` bytes: its tensors' by default), evicting the least recently used entries until
        the store is within its bound."""
        size = nbytes(value) if size is None else size
        with self._lock:
            if size > self.max_bytes:
                self.too_large += 1
                return
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, freed) = self._items.popitem(last=False)
                self.bytes -= freed
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        """Whether `key` is stored (neither a hit nor a miss, nor a use)."""
        with self._lock:
            return key in self._items

    def stats(self) -> dict:
        return {
            "entries": len(self._items), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
            "misses": self.misses, "evictions": self.evictions, "too_large": self.too_large,
        }  # fmt: skip
