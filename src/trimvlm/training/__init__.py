"""Training what the methods read at inference: the meta-router (`router.py`, `trimvlm train-router`; its DPO
objective in `dpo.py`). It sits beside `tune` and `evals` (it reads tasks and the cost prediction); the method
packages it trains (`trimvlm.router`) never import it."""
