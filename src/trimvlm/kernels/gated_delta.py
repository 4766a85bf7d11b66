"""The gated delta rule in its recurrent (step) form, at the segment's own length.

Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", 2024)
keeps per value head a state S [d_k, d_v] and, per token t, with the key and query L2-normalised
(k = k / |k|, q = q / |q| / sqrt(d_k)), a decay alpha_t = exp(g_t) in (0, 1] and a write strength beta_t:

    S   <- alpha_t S                        gated forgetting
    u_t  = beta_t (v_t - S^T k_t)           the delta rule: only what the memory does not already predict
    S   <- S + k_t u_t^T                    rank-1 write
    o_t  = S^T q_t                          read-out

A chunked kernel (transformers' PyTorch fallback) computes the same thing over blocks of 64 tokens and pads
every call to a multiple of 64; here a segment of T tokens costs T steps of three [d_k x d_v] products per head
and holds one state per row, nothing of size 64.

Invalid positions (`valid` False) are absent: alpha = 1 and beta = 0 there, so the state passes them unchanged
(exactly: S * 1 + k * 0), and the loop stops after the last position any row holds. Rows start from rows
`rows` of a table of states (read, never written: a shared prefix's states are not copied per row before the
first step, which materialises each row's own state anyway).
"""

from __future__ import annotations

import torch


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the normalisation Gated DeltaNet applies to q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _start(state: torch.Tensor | None, rows: torch.Tensor | None, shape: tuple, device) -> tuple:
    """The rows' start states [B * H_v, d_k, d_v] in float32, and whether they are a tensor of their own (else
    `state` itself, which the loop must not write)."""
    if state is None:
        return torch.zeros(shape, dtype=torch.float32, device=device), True
    if rows is not None:
        return state.index_select(0, rows).to(torch.float32).reshape(shape), True
    s = state.to(torch.float32).reshape(shape)  # a broadcast view is copied here, once
    return s, s.data_ptr() != state.data_ptr()


def gated_delta_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over a segment.

    q, k [B, T, H_k, d_k]; v [B, T, H_v, d_v] (H_v a multiple of H_k: each q/k head serves H_v / H_k
    consecutive value heads); g (log decay, <= 0) and beta [B, T, H_v]; `state` [R, H_v, d_k, d_v] the start
    states (None: zeros), row b starting from `state[rows[b]]` (rows None: R == B, row b from row b); `valid`
    [B, T] bool (None: all valid). Returns the outputs [B, T, H_v, d_v] in q's dtype and the final states
    [B, H_v, d_k, d_v] in float32 (new tensors)."""
    b, t, h_k, d_k = k.shape
    h_v, d_v = v.shape[-2:]
    if h_v % h_k:
        raise ValueError(f"{h_v} value heads are not a multiple of {h_k} key heads")
    bh = b * h_v
    f32 = torch.float32
    qn = l2_normalise(q.to(f32)) * d_k**-0.5
    kn = l2_normalise(k.to(f32))
    if h_v != h_k:
        qn, kn = (x.repeat_interleave(h_v // h_k, dim=2) for x in (qn, kn))
    alpha, bet = g.to(f32).exp(), beta.to(f32)
    steps = t
    if valid is not None:
        alpha = alpha.masked_fill(~valid[..., None], 1.0)
        bet = bet.masked_fill(~valid[..., None], 0.0)
        held = torch.nonzero(valid.any(0)).flatten()
        steps = int(held[-1]) + 1 if held.numel() else 0
    # time-major, so that each step's [B * H, 1, d] slice is a contiguous view
    qs, ks, vs = (x.transpose(0, 1).reshape(t, bh, 1, x.shape[-1]) for x in (qn, kn, v.to(f32)))
    alphas, betas = (x.transpose(0, 1).reshape(t, bh, 1, 1) for x in (alpha, bet))
    inplace = not torch.is_grad_enabled()
    s, own = _start(state, rows, (bh, d_k, d_v), v.device)
    kq = torch.cat([ks, qs], dim=2)  # [T, BH, 2, d_k]: k and q read the old state in one product
    qk = (qs * ks).sum(-1, keepdim=True)  # [T, BH, 1, 1]
    out = torch.zeros(t, bh, 1, d_v, dtype=f32, device=v.device)
    for i in range(steps):
        # with S' = alpha S + k u^T: k^T (alpha S) = alpha k^T S and q^T S' = alpha q^T S + (q . k) u, so the
        # state is read once (k^T S, q^T S) and written once (decay, then the rank-1 write)
        read = torch.bmm(kq[i], s) * alphas[i]  # [BH, 2, d_v]
        u = (vs[i] - read[:, :1]) * betas[i]  # [BH, 1, d_v]
        out[i] = read[:, 1:] + qk[i] * u
        s = s.mul_(alphas[i]) if inplace and own else s * alphas[i]
        own = True
        s = s.baddbmm_(ks[i].transpose(1, 2), u) if inplace else torch.baddbmm(s, ks[i].transpose(1, 2), u)
    if steps == 0 and not own:
        s = s.clone()
    out = out.reshape(t, b, h_v, d_v).transpose(0, 1).to(q.dtype)
    return out, s.reshape(b, h_v, d_k, d_v)
