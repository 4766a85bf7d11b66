"""The Pruning All-Rounder meta-router (REFERENCES.md section 5): per input, which visual tokens to keep and
which candidate layers to skip, scored by one small transformer block over [visual tokens; text tokens; layer
embeddings], trained self-supervised with DPO over pruning layouts. Built so far (issue 11): the model and its checkpoints
(`model.py`), the DPO objective (`dpo.py`) and the `router=` recipe axis that executes a router's layout
(`route.py`); the layout sampler, the training command and the shipped routers are not built yet (docs/depth.md)."""
