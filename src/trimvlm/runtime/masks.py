"""Boolean attention masks (True = may attend) for one chunk of queries against a layer's past and itself."""

from __future__ import annotations

import torch


def chunk_mask(
    past_valid: torch.Tensor | None,
    new_valid: torch.Tensor,
    within: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, 1, Q, Kp + Q]: every query sees the valid past entries and, inside the chunk, `within`
    ([B, Q, Q] bool, default causal) restricted to valid keys. A query always sees itself, so padded rows
    stay finite (their outputs are never read)."""
    b, q = new_valid.shape
    dev = new_valid.device
    if within is None:
        within = torch.ones(q, q, dtype=torch.bool, device=dev).tril()[None].expand(b, q, q)
    eye = torch.eye(q, dtype=torch.bool, device=dev)[None]
    own = (within & new_valid[:, None, :]) | eye
    if past_valid is None or past_valid.shape[1] == 0:
        return own[:, None]
    past = past_valid[:, None, :].expand(b, q, past_valid.shape[1])
    return torch.cat([past, own], dim=-1)[:, None]
