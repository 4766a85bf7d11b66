"""lmms-eval tasks that read a benchmark's local copy instead of the Hugging Face hub.

Each `<task>_local.yaml` here is lmms-eval's own task (its prompt, its scoring and metric functions, imported by
`utils.py` from the installed lmms-eval) with the data read from parquet shards under `lmms_data/<name>/` in
the folder lmms-eval runs in (a link to your copy will do):

    ln -s /data/POPE lmms_data/pope
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m lmms_eval --model trimvlm --model_args pretrained=demo \\
        --tasks pope_local --include_path "$(python -m trimvlm.integrations.lmms_tasks)" --batch_size 8

`python -m trimvlm.integrations.lmms_tasks` prints this folder; `TASKS` names the tasks and the folder each
reads. MMBench and MM-Vet are left out: lmms-eval scores them with a GPT judge, which a local run cannot reach.
"""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
TASKS = {  # task name -> the folder under lmms_data/ its shards are read from
    "pope_local": "pope",
    "scienceqa_img_local": "scienceqa_img",
    "ai2d_local": "ai2d",
    "textvqa_val_local": "textvqa",
    "docvqa_val_local": "docvqa",
    "infovqa_val_local": "infovqa",
    "chartqa_local": "chartqa",
}
