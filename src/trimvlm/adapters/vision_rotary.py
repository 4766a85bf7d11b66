"""The Qwen-VL towers' rotary embedding, compiled (`kernels.rotary`), while trimvlm encodes images.

The towers call their modeling module's `apply_rotary_pos_emb_vision(q, k, cos, sin)` in every layer, in six
passes over q and k where one suffices.
`compiled_rotary(tower)` puts the compiled rotation in that module's place while its context is open, for the
calls it can take (`kernels.rotary.usable`: float32 on the CPU, numba present); any other call runs the module's
own function. Both give the same values bit for bit, so two threads encoding at once can only differ in which
one they run; the last context out puts the module's own function back.
"""

from __future__ import annotations

import contextlib
import sys

from trimvlm.kernels import rotary
from trimvlm.runtime.held import Held

NAME = "apply_rotary_pos_emb_vision"
_HELD = Held()  # per modeling module: its own function while encodes run the compiled one


def compiled_rotary(tower):
    """Inside: the modeling module of `tower` (a vision model) rotates with the compiled loop where it can. A
    tower whose module has no `apply_rotary_pos_emb_vision`, or None: nothing changes."""
    name = type(tower).__module__ if tower is not None else ""
    module = sys.modules.get(name)
    if module is None or not callable(getattr(module, NAME, None)):
        return contextlib.nullcontext()

    def change():
        own = getattr(module, NAME)

        def apply(q, k, cos, sin):
            if rotary.usable(q, k, cos, sin):
                return rotary.rotate(q, k, cos, sin)
            return own(q, k, cos, sin)

        setattr(module, NAME, apply)
        return lambda: setattr(module, NAME, own)

    return _HELD.holding(name, change)
