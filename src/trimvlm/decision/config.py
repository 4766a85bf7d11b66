"""Which `DecisionConfig` (transformers' settings of a decision model: template, labels, temperatures) a call uses.

In the order transformers' `DecisionPipeline` looks: the one given; else a decision model's own (read with its
weights, like `generation_config`); else the checkpoint folder's `decision.json` / `decision_template.jinja`;
else, for trimvlm's demo checkpoints (which ship none), `demo_template.demo_decision_config()`; else the
defaults (transformers' generic prompt inside the tokenizer's chat template, labels `Yes`/`No` and `A`, `B`...).
"""

from __future__ import annotations

from pathlib import Path

from trimvlm.decision.demo_template import demo_decision_config
from trimvlm.decision.errors import DecisionError


def resolve_config(vlm, decision_config=None):
    """A `DecisionConfig` from one, a dict of its fields, a folder or a `decision.json` path, or None (the
    model's, see the module docstring)."""
    from transformers.decision import DecisionConfig

    if isinstance(decision_config, DecisionConfig):
        return decision_config
    if decision_config is None:
        return vlm.decision_config
    if isinstance(decision_config, dict):
        try:
            return DecisionConfig(**decision_config)
        except Exception as e:  # strict dataclass: TypeError / StrictDataclassError for bad fields
            raise DecisionError(f"invalid decision config: {' '.join(str(e).split())[:300]}") from e
    if isinstance(decision_config, str | Path):
        path = Path(decision_config).expanduser()
        try:
            if path.is_dir():
                return DecisionConfig.from_pretrained(path)
            if path.is_file():
                config = DecisionConfig.from_file(path)
                template = path.with_name("decision_template.jinja")
                if template.is_file():
                    config.chat_template = template.read_text(encoding="utf-8")
                return config
        except Exception as e:  # JSON or field errors
            raise DecisionError(f"invalid decision config {path}: {' '.join(str(e).split())[:300]}") from e
        raise DecisionError(f"decision config not found: {path} (a folder with decision.json, or the file)")
    raise DecisionError(
        f"decision_config must be a DecisionConfig, a dict, a path or None, got {type(decision_config).__name__}"
    )


def model_config(adapter):
    """The checkpoint's own decision config (`VLM.decision_config` reads it once per model)."""
    from transformers.decision import DecisionConfig

    if adapter.decision_config is not None:
        return adapter.decision_config
    folder = adapter.folder
    ships = ("decision.json", "decision_template.jinja")
    if folder is not None and any((folder / f).exists() for f in ships):
        return DecisionConfig.from_pretrained(folder)
    if folder is not None and _is_demo(folder):
        return demo_decision_config()
    return DecisionConfig()


def _is_demo(folder: Path) -> bool:
    from trimvlm.loading import DEMO_DIR

    try:
        return folder.resolve().parent == DEMO_DIR.resolve()
    except OSError:
        return False
