"""The layer rankings a space's depth points read, calibrated by tune on the validation inputs (answers are
never read) and kept in `OUT/rankings/<method>.json`: an existing file for this model is reused (a resumed
run), one for another model is calibrated again."""

from __future__ import annotations

import json
from pathlib import Path

from trimvlm.depth.base import model_fingerprint
from trimvlm.depth.calibration import rank, write_ranking

CALIBRATION_INPUTS = 48


def calibrate_rankings(vlm, space, val, folder: Path, batch_size: int = 16) -> None:
    fp = model_fingerprint(vlm.adapter)
    for method in space.rankers:
        path = Path(folder) / f"{method}.json"
        if path.exists() and json.loads(path.read_text()).get("fingerprint") == fp:
            continue
        records = val.records[:CALIBRATION_INPUTS]
        write_ranking(rank(vlm, method, records, batch_size, calibration={"task": val.name, "split": "val"}), path)
