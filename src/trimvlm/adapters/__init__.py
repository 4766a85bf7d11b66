"""Model-family adapters: the only place that knows a family's internals. One file per family.

`ADAPTERS` maps a checkpoint's `model_type` to `module:Class`; modules are imported on first use.
"""

from __future__ import annotations

import importlib

from trimvlm.errors import UnsupportedModelError

ADAPTERS = {
    "qwen3_vl": "qwen3_vl:Qwen3VLAdapter",
    "qwen2_5_vl": "qwen2_5_vl:Qwen25VLAdapter",
    "llava": "llava:LlavaAdapter",
    "idefics3": "idefics3:Idefics3Adapter",
    "smolvlm": "idefics3:SmolVLMAdapter",
    "qwen3_5": "qwen3_5:Qwen35Adapter",
    "internvl": "internvl:InternVLAdapter",
}


def adapter_for(model_type: str) -> type:
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"unsupported model family {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}"
        )
    module, cls = ADAPTERS[model_type].split(":")
    return getattr(importlib.import_module(f"trimvlm.adapters.{module}"), cls)
