"""The local-copy lmms-eval tasks shipped in trimvlm.integrations.lmms_tasks: each loads with lmms-eval's own
task loader (every function it names resolves), and lmms-eval's CLI runs pope_local on the POPE fixture and
gives, question by question, the predictions `trimvlm eval --task pope` gives on the same copy. Needs
lmms-eval (`make lmms`); no hub: HF_*_OFFLINE=1."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

from conftest import optional

_, pytestmark = optional("lmms_eval", "`make lmms` installs it")

N = 30  # fixture rows


def test_every_shipped_task_loads_with_lmms_evals_loader():
    from lmms_eval.utils import load_yaml_config

    from trimvlm.integrations.lmms_tasks import FOLDER, TASKS

    files = sorted(FOLDER.glob("*.yaml"))
    assert {f.stem for f in files} == set(TASKS)
    for f in files:
        cfg = load_yaml_config(yaml_path=str(f), mode="full")
        assert cfg["task"] == f.stem and cfg["dataset_path"] == "parquet"
        (pattern,) = cfg["dataset_kwargs"]["data_files"].values()
        assert pattern.startswith(f"lmms_data/{TASKS[f.stem]}/")
        assert list(cfg["dataset_kwargs"]["data_files"]) == [cfg["test_split"]]
        for key in ("doc_to_visual", "doc_to_text", "process_results"):
            assert key not in cfg or callable(cfg[key]), (f.name, key)
        for metric in cfg["metric_list"]:
            assert isinstance(metric["aggregation"], str) or callable(metric["aggregation"])


def test_lmms_eval_cli_on_the_pope_fixture_gives_trimvlms_predictions(tmp_path):
    from trimvlm.integrations.lmms_tasks import FOLDER
    from trimvlm.testing.cli import run_cli

    spec = importlib.util.spec_from_file_location(
        "fixture_benchmark", FOLDER.parents[3] / "benchmarks" / "fixture_benchmark.py"
    )
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    copy = tmp_path / "POPE"
    fixture.main(["--out", str(copy), "--n", str(N)])
    (tmp_path / "lmms_data").mkdir()
    (tmp_path / "lmms_data" / "pope").symlink_to(copy)

    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "trimvlm", "--model_args", "pretrained=demo,device=cpu",
           "--tasks", "pope_local", "--include_path", str(FOLDER), "--batch_size", str(N),
           "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (samples,) = glob.glob(str(tmp_path / "out" / "**" / "*_samples_pope_local.jsonl"), recursive=True)
    lmms = {}
    for line in open(samples):
        s = json.loads(line)["pope_accuracy"]
        lmms[s["question_id"]] = s["prediction"]

    res = run_cli("eval", "--model", "demo", "--task", "pope", "--data", copy, "--batch-size", N,
                  "--json", tmp_path / "t.json")  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "t.json").read_text())
    ours = {item["id"]: out.strip().lower()
            for item, out in zip(data["items"], data["predictions"]["baseline"]["outputs"], strict=True)}  # fmt: skip
    assert len(lmms) == len(ours) == N
    assert lmms == ours
