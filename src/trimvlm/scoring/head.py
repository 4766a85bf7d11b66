"""The decision head (docs/references.md#branches-features-and-the-decision-head): reads the question
representation z_q, each candidate's representation u_i and its language-model features, and gives candidate
logits plus an abstention logit.

    g = tanh(W_q z_q);  h_i = (W_o u_i) * g + W_f feats_i
    logit_i = (w . h_i + v . feats_i) / tau;  abstain = (W_a g) / tau
    choice: softmax over [logit_1 .. logit_N, abstain];  binary: P(true) = sigmoid(logit) ([logit, 0])

tau is a learned temperature (its log is the parameter). Saved next to a checkpoint as
`decision_head.safetensors` + `decision_head.json`; the backbone is never changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from trimvlm.errors import CheckpointError
from trimvlm.scoring.readout import N_FEATURES

WEIGHTS = "decision_head.safetensors"
CONFIG = "decision_head.json"


class DecisionHead(nn.Module):
    def __init__(self, hidden_size: int, width: int = 64, n_features: int = N_FEATURES):
        super().__init__()
        self.hidden_size, self.width, self.n_features = hidden_size, width, n_features
        self.w_q = nn.Linear(hidden_size, width)
        self.w_o = nn.Linear(hidden_size, width)
        self.w_f = nn.Linear(n_features, width)
        self.w = nn.Linear(width, 1, bias=False)
        self.v = nn.Linear(n_features, 1, bias=False)
        self.w_a = nn.Linear(width, 1)
        self.log_tau = nn.Parameter(torch.zeros(()))

    def forward(self, z_q: torch.Tensor, u: torch.Tensor, feats: torch.Tensor):
        """z_q [R, D], u [R, N, D], feats [R, N, F] -> (logits [R, N], abstain [R])."""
        tau = self.log_tau.exp()
        g = torch.tanh(self.w_q(z_q))  # [R, W]
        h = self.w_o(u) * g[:, None] + self.w_f(feats)
        logits = (self.w(h).squeeze(-1) + self.v(feats).squeeze(-1)) / tau
        abstain = self.w_a(g).squeeze(-1) / tau
        return logits, abstain

    def flops(self, n_candidates: int) -> int:
        """Matmul FLOPs (2 per multiply-add) of one request with n candidates."""
        d, w, f = self.hidden_size, self.width, self.n_features
        return 2 * (d * w + w + n_candidates * (d * w + f * w + w + f))

    def save(self, folder: str | Path, meta: dict | None = None) -> None:
        folder = Path(folder)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, folder / WEIGHTS)
        cfg = {"hidden_size": self.hidden_size, "width": self.width, "n_features": self.n_features}
        (folder / CONFIG).write_text(json.dumps({**cfg, **(meta or {})}, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path | None, device: torch.device | str = "cpu") -> DecisionHead | None:
        """The head saved in `folder` on `device` (the readout moves its inputs to it), or None when there is
        none."""
        if folder is None or not (Path(folder) / WEIGHTS).exists():
            return None
        cfg = json.loads((Path(folder) / CONFIG).read_text())
        head = cls(cfg["hidden_size"], cfg["width"], cfg["n_features"])
        try:
            # assign: the loaded (host) tensors become the parameters, whatever the default device is
            head.load_state_dict(load_file(Path(folder) / WEIGHTS), assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"decision head in {folder} does not match its config: {e}") from e
        return head.to(device).eval()
