"""Decode-phase visual-KV eviction policies; each registers itself in trimvlm.registry (one file per policy).

    kv=density:keep=0.25    kv=h2o:keep=0.25    kv=snapkv:keep=0.25    kv=streamingllm:keep=0.25
    kv=random:keep=0.25:seed=0    kv=lookm:keep=0.25    kv=vlcache:keep=0.25    kv=aircache:keep=0.25

See `trimvlm.kv.base` for the interface and docs/kv.md for the policies and their options.
"""

from trimvlm.kv import aircache, density, h2o, lookm, random, snapkv, streamingllm, vlcache  # noqa: F401
from trimvlm.kv.base import KVPolicy, LayerView, mask_out

__all__ = ["KVPolicy", "LayerView", "mask_out"]
