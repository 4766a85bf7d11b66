"""The switch for the compiled per-pick loops: numba when it is installed, the numpy / torch loops
they replace when it is not, or when `TRIMVLM_JIT=0` (read at import) or `ENABLED = False` (tests) asks for them.

Both paths make the same picks bit for bit: a compiled loop does the same float operations, in the same order
and precision, as the array code it replaces (no fast-math, no reordering), and reads the same matrix products,
which stay torch calls (counted as method FLOPs, so the FLOPs are the work, whichever loop ran).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

# numba itself is imported by the modules of the compiled loops (kernels.picks, kernels.windows), on first use
AVAILABLE = importlib.util.find_spec("numba") is not None
_FLOATS = (torch.float32, torch.float64)
ENABLED = AVAILABLE and os.environ.get("TRIMVLM_JIT", "1") != "0"


def compiled(*tensors, cpu: bool = False) -> bool:
    """Whether the compiled loops run (numba present and not switched off) on these torch tensors: float32 or
    float64 ones (numba's float16 is partial), and with `cpu` only on the CPU (loops that read the tensors'
    memory)."""
    return ENABLED and AVAILABLE and all(t.dtype in _FLOATS and (not cpu or t.device.type == "cpu") for t in tensors)


@contextlib.contextmanager
def switched(on: bool):
    """The compiled loops on (where numba is installed) or off inside the block, whatever TRIMVLM_JIT says."""
    global ENABLED
    before, ENABLED = ENABLED, bool(on)
    try:
        yield
    finally:
        ENABLED = before


def disabled():
    """Run the numpy / torch fallback loops inside the block (tests, benchmarks)."""
    return switched(False)


def njit(fn=None, **options):
    """`numba.njit(cache=True, nogil=True, **options)` (compiled on first call, cached on disk; releases the
    GIL, so two threads can run two samples' loops at once), or `fn` itself without numba (never called then)."""
    if fn is None:
        return lambda f: njit(f, **options)
    if not AVAILABLE:  # pragma: no cover
        return fn
    import numba

    return numba.njit(cache=True, nogil=True, **options)(fn)
