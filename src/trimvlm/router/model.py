"""O_phi, the meta-router: one pre-norm transformer block over concat[V; Q; L] and two sigmoid heads.

    V = W_v x_v (the visual tokens entering the LLM, projected to `width`),  Q = W_q x_t (the text tokens),
    L = N learnable embeddings, one per candidate layer (by default the last half of the decoder);
    h = Block([V; Q; L]) (self-attention with a padding mask, then an MLP, both residual, pre-norm);
    s_v = sigmoid(MLP_v(h_V)) keep score of each visual token, s_l = sigmoid(MLP_l(h_L)) keep score of each
    candidate layer.

Batched with padding: a padded batch equals each input alone (padded positions are masked out of the
attention and their scores are 0). Every matmul runs through `kernels.flops`, so the router's own FLOPs land
on the method line when it runs inside a counted region.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from trimvlm.errors import RecipeError
from trimvlm.kernels.flops import count, matmul


class _Linear(nn.Linear):
    def forward(self, x):
        count(2 * x[..., 0].numel() * self.in_features * self.out_features)
        return super().forward(x)


class MetaRouter(nn.Module):
    def __init__(self, hidden: int, candidate_layers: list[int], width: int = 128, heads: int = 4, ff: int = 4):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.candidate_layers = [int(i) for i in candidate_layers]
        self.width, self.heads = width, heads
        self.vis, self.txt = _Linear(hidden, width), _Linear(hidden, width)
        self.layer_emb = nn.Parameter(torch.randn(len(self.candidate_layers), width) * 0.02)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = _Linear(width, 3 * width), _Linear(width, width)
        self.mlp = nn.Sequential(_Linear(width, ff * width), nn.GELU(), _Linear(ff * width, width))
        self.head_v = nn.Sequential(_Linear(width, width), nn.GELU(), _Linear(width, 1))
        self.head_l = nn.Sequential(_Linear(width, width), nn.GELU(), _Linear(width, 1))

    def forward(self, vis, vis_mask, txt, txt_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """vis [B, Nv, D], vis_mask [B, Nv] bool, txt [B, Nt, D], txt_mask [B, Nt] bool -> (token scores
        [B, Nv], 0 on padding; layer scores [B, N])."""
        z_v, z_l = self.logits(vis, vis_mask, txt, txt_mask)
        return torch.sigmoid(z_v).masked_fill(~vis_mask, 0.0), torch.sigmoid(z_l)

    def logits(self, vis, vis_mask, txt, txt_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores before the sigmoid (training reads these: log s = logsigmoid(z) never saturates to a
        clamp). Padded tokens' logits are -inf."""
        b, nv = vis_mask.shape
        n = len(self.candidate_layers)
        dt = self.layer_emb.dtype
        x = torch.cat([self.vis(vis.to(dt)), self.txt(txt.to(dt)), self.layer_emb.expand(b, -1, -1)], dim=1)
        keep = torch.cat([vis_mask, txt_mask, torch.ones(b, n, dtype=torch.bool, device=x.device)], dim=1)
        x = x + self._attend(self.norm1(x), keep)
        x = x + self.mlp(self.norm2(x))
        z_v = self.head_v(x[:, :nv]).squeeze(-1).masked_fill(~vis_mask, float("-inf"))
        return z_v, self.head_l(x[:, -n:]).squeeze(-1)

    def _attend(self, x, keep):
        b, t, w = x.shape
        h, d = self.heads, w // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4)
        s = matmul(q, k.transpose(-1, -2)) * d**-0.5
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        a = torch.softmax(s, dim=-1)
        return self.out(matmul(a, v).transpose(1, 2).reshape(b, t, w))


CONFIG = "router.json"
WEIGHTS = "router.safetensors"


def save_router(router: MetaRouter, folder, *, fingerprint: str, hidden: int, extra: dict | None = None) -> None:
    """Write the router to `folder` (weights + a JSON config naming the model it was built for)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in router.state_dict().items()}, str(folder / WEIGHTS))
    meta = {"hidden": hidden, "candidate_layers": router.candidate_layers, "width": router.width,
            "heads": router.heads, "ff": router.mlp[0].out_features // router.width, "fingerprint": fingerprint,
            **(extra or {})}  # fmt: skip
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def router_folder(folder):
    """A router folder, or a demo model's name ("demo", "demo-qwen35"): the router shipped next to its
    checkpoint."""
    from trimvlm.loading import DEMO_DIR, DEMO_MODELS

    key = str(folder)
    return DEMO_DIR / DEMO_MODELS[key] / "router" if key in DEMO_MODELS else Path(folder)


def load_router(folder) -> tuple[MetaRouter, dict]:
    """The router saved in `folder` and its config (TrimVLMError when it is not a router checkpoint).
    `folder` may name a demo model ("demo", "demo-qwen35"): the router shipped next to its checkpoint.
    Read from disk once per checkpoint (and again only when its files change); the module is shared, in eval
    mode, and never trained by its readers."""
    folder = router_folder(folder)
    if not (folder / CONFIG).exists() or not (folder / WEIGHTS).exists():
        raise RecipeError(f"router checkpoint not found: {folder} needs {CONFIG} and {WEIGHTS} (trimvlm train-router)")
    stamp = tuple((folder / f).stat().st_mtime_ns for f in (CONFIG, WEIGHTS))
    return _read_router(str(folder.resolve()), stamp)


@functools.lru_cache(maxsize=16)
def _read_router(folder: str, stamp: tuple) -> tuple[MetaRouter, dict]:
    folder = Path(folder)
    try:
        meta = json.loads((folder / CONFIG).read_text())
        router = MetaRouter(int(meta["hidden"]), meta["candidate_layers"], int(meta["width"]), int(meta["heads"]),
                            int(meta.get("ff", 4)))  # fmt: skip
        router.load_state_dict(load_file(str(folder / WEIGHTS)))
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise RecipeError(f"{folder} is not a router checkpoint: {e}") from e
    return router.eval(), meta
