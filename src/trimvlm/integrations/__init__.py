"""Bridges to other tools' interfaces (each behind an optional dependency): `lmms` for lmms-eval."""
