"""Samples in parallel: a compiled loop that releases the GIL (`kernels.jit`) run on chunks of a batch's units
in a small thread pool, one chunk per thread torch is allowed (`torch.get_num_threads()`). Each unit's work
reads and writes only that unit's rows, so the result does not depend on the threads or on the split.
`TRIMVLM_UNIT_THREADS=0` (read at import) keeps every chunk on the calling thread."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# per unit, token-steps below which one thread does it all (a pool call costs ~50 us); TRIMVLM_UNIT_THREADS=0: never
MIN_WORK = 1 << 62 if os.environ.get("TRIMVLM_UNIT_THREADS", "1") == "0" else 1 << 15

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_size = 0


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _size
    with _lock:
        if _pool is None or _size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _size = ThreadPoolExecutor(n, thread_name_prefix="trimvlm-units"), n
        return _pool


def for_units(fn, units: np.ndarray, work: int) -> None:
    """fn(chunk) for chunks of `units` (int64 [U']) covering them all, in parallel when there are threads to
    spare and each unit has `work` >= MIN_WORK; returns when every chunk is done (re-raising a chunk's error)."""
    n = min(max(1, torch.get_num_threads()), len(units))
    if n <= 1 or work < MIN_WORK:
        fn(units)
        return
    chunks = [c for c in np.array_split(units, n) if len(c)]
    futures = [_executor(n).submit(fn, c) for c in chunks[1:]]
    fn(chunks[0])
    for f in futures:
        f.result()
