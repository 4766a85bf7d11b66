"""Decode-phase visual-KV eviction policies (`kv=` in a recipe), one per module. Importing this package imports
every module in it (`protocol.discover`: no list kept by hand), and each registers its policy in
trimvlm.registry.

    kv=density:keep=0.25    kv=h2o:keep=0.25    kv=snapkv:keep=0.25    kv=streamingllm:keep=0.25

See `trimvlm.kv.base` for the interface, docs/kv.md for the policies and their options, and `trimvlm methods`
for every registered one.
"""

from trimvlm.kv.base import KVPolicy, LayerView, mask_out
from trimvlm.protocol import discover

__all__ = ["KVPolicy", "LayerView", "mask_out"]

discover(__name__)
