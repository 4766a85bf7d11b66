"""tokens methods register themselves in trimvlm.registry (one file per method)."""
