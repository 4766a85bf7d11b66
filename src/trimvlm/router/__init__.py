"""The Pruning All-Rounder meta-router (REFERENCES.md section 5): per input, which visual tokens to keep and
which candidate layers to skip, scored by one small transformer block over [visual tokens; text tokens; layer
embeddings], trained self-supervised with DPO over pruning layouts. Built so far (issue 11): the model
(`model.py`) and the DPO objective (`dpo.py`); the layout sampler, training command, the `router=` recipe axis
and the shipped routers are not built yet (docs/depth.md)."""
