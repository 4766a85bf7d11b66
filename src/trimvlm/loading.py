"""`trimvlm.load`: a local checkpoint folder (or "demo") -> a VLM with the right adapter."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trimvlm.adapters import ADAPTERS, adapter_for
from trimvlm.adapters.base import checkpoint_meta
from trimvlm.errors import CheckpointError, InputError, did_you_mean

DEMO_DIR = Path(__file__).parent / "demo" / "checkpoints"
DEMO_MODELS = {"demo": "qwen3vl", "demo-qwen3vl": "qwen3vl", "demo-qwen35": "qwen35", "demo-scenes": "scenes"}


def resolve(path_or_id: str | Path) -> Path:
    key = str(path_or_id)
    if key in DEMO_MODELS:
        folder = DEMO_DIR / DEMO_MODELS[key]
        if not (folder / "config.json").exists():
            raise CheckpointError(f"the demo checkpoint {key!r} is not shipped in this install ({folder})")
        return folder
    folder = Path(key).expanduser()
    if folder.is_dir():
        return folder
    cached = _hub_snapshot(key)
    if cached is not None:
        return cached
    raise CheckpointError(
        f"checkpoint not found: {key!r} is neither a local folder nor a model in the local hub cache "
        "(no model hub is reachable here; download the checkpoint and pass its folder)"
        + did_you_mean(Path(key).name, _near(key))
    )


def _near(key: str) -> dict[str, str]:
    """What a mistyped model may have meant, by the name compared to its last part: the demo models and the
    checkpoint folders (holding a config.json) beside the folder it names, shown as paths like it."""
    names = {name: name for name in DEMO_MODELS}
    given = Path(key)
    try:
        for p in given.expanduser().parent.iterdir():
            if (p / "config.json").is_file():
                names[p.name] = str(given.parent / p.name)
    except OSError:  # no such folder, or not readable
        pass
    return names


def checkpoint_task(path_or_id: str | Path | None) -> str:
    """The demo task a checkpoint was trained on (its trimvlm.json `task`: `demo` or `scenes`); `demo` for a
    checkpoint that names none or cannot be found (loading it reports that)."""
    try:
        meta = checkpoint_meta(resolve(path_or_id)) if path_or_id is not None else None
    except CheckpointError:
        return "demo"
    return str((meta or {}).get("task", "demo"))


def refuse_shipped(folder: str | Path, overwrite: bool) -> None:
    """A command that writes into `folder` refuses when it is (or lies inside) a demo checkpoint shipped with
    trimvlm, unless `overwrite` was asked for (the CLI's --overwrite)."""
    path = Path(folder).expanduser().resolve()
    if not overwrite and path.is_relative_to(DEMO_DIR.resolve()):
        raise InputError(
            f"{folder} is a shipped demo checkpoint ({path}); pass --overwrite to replace it, or --out FOLDER"
        )


def _hub_snapshot(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        return None


def read_model_type(folder: Path) -> str:
    cfg = folder / "config.json"
    if not cfg.exists():
        raise CheckpointError(f"{folder} is not a checkpoint folder: it has no config.json")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg} is not valid JSON: {e}") from e
    model_type = data.get("model_type")
    if not model_type:
        raise CheckpointError(f"{cfg} has no model_type; supported families: {', '.join(sorted(ADAPTERS))}")
    return model_type


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


def parse_dtype(dtype) -> torch.dtype:
    """A torch dtype from a dtype or its name (float32 | bfloat16 | float16, or fp32 / bf16 / fp16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise CheckpointError(f"unknown dtype {dtype!r}; allowed: float32, bfloat16, float16")


def parse_device(device) -> torch.device:
    """A torch device that exists on this machine (cpu, cuda, cuda:N, mps)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise CheckpointError(f"unknown device {device!r}; e.g. cpu, cuda, cuda:1") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"device {device!r} asked for, but this machine has no CUDA GPU (use cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CheckpointError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise CheckpointError(f"device {device!r} asked for, but MPS is not available here (use cpu)")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise CheckpointError(f"device {device!r} is not supported; allowed: cpu, cuda[:N], mps")
    return dev


def load_adapter(path_or_id, dtype: torch.dtype | str = torch.float32, device: str = "cpu"):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype, device = parse_dtype(dtype), parse_device(device)
    folder = resolve(path_or_id)
    from trimvlm.adapters.jev import is_decision_checkpoint, load_decision_adapter

    if is_decision_checkpoint(folder):  # JevForDecision: its backbone through its family's adapter, and its head
        return load_decision_adapter(folder, dtype, device)
    adapter_cls = adapter_for(read_model_type(folder))
    try:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    except OSError as e:
        raise CheckpointError(
            f"{folder} is not a complete checkpoint (model, tokenizer, image processor): {e}"
        ) from e
    return adapter_cls(model, tokenizer, image_processor, folder=folder)
