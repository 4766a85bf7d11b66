"""The Pruning All-Rounder meta-router (docs/references.md#the-meta-router): per input, which visual tokens to
keep and which candidate layers to skip, scored by one small transformer block over [visual tokens; text
tokens; layer embeddings], trained self-supervised with DPO over pruning layouts (trimvlm.training.router,
`trimvlm train-router`). `model.py` (the router and its checkpoints), `route.py` (the `router=` recipe axis),
`budget.py` (v2's per-input choice under a total-FLOP budget). docs/depth.md and docs/tune.md."""
