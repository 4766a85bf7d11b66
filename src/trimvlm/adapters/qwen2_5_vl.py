"""Qwen2.5-VL: M-RoPE (3 axes) from the model's own rule, vision tower with window attention, no deepstack.
Everything it needs is the shared Qwen-VL front end."""

from __future__ import annotations

from trimvlm.adapters.base import Adapter
from trimvlm.adapters.qwen3_vl import QwenVLAdapterMixin


class Qwen25VLAdapter(QwenVLAdapterMixin, Adapter):
    family = "qwen2_5_vl"
