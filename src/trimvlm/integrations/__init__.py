"""Bridges to other tools (each behind an optional dependency): `lmms` for lmms-eval, `ray_eval` for the one
harness sharded over Ray workers (each loads the model: it sits above `vlm`)."""
