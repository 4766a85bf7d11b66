"""`trimvlm eval --task pope --data PATH`: a benchmark copy in the Hugging Face layout, end to end on the demo
model, and bad benchmark input as one line on stderr."""

import json

import torch

from trimvlm.testing.benchmark_copies import pope_rows, write_parquet, write_shards
from trimvlm.testing.cli import assert_one_line_error as _one_line_error
from trimvlm.testing.cli import run_cli as _cli


def test_eval_pope_from_parquet_on_the_demo_model(tmp_path):
    torch.set_num_threads(1)
    data = write_shards(tmp_path / "POPE", "test", pope_rows(6), shards=2)
    out = tmp_path / "pope.json"
    res = _cli("eval", "--model", "demo", "--task", "pope", "--data", data, "--split", "test", "--limit", 4,
               "--seed", 3, "--json", out, "--plot", tmp_path / "pope.png")  # fmt: skip
    assert res.exit_code == 0, res.output
    data_out = json.loads(out.read_text())
    assert data_out["task"]["name"] == "pope" and data_out["task"]["items"] == 4
    assert (
        data_out["task"]["split"] == "test"
        and data_out["task"]["selection"] == "4 of 6 rows drawn with seed 3"
    )
    rows = {r["group"]: r for r in data_out["results"] if r["recipe"] == "baseline"}
    assert rows["all"]["metric"] == "yesno" and rows["prefill"]["n"] == 4
    for key in ("accuracy", "f1", "precision", "recall", "predicted_yes_ratio"):
        assert 0.0 <= rows["all"][key] <= 1.0, key
    assert "all F1" in res.output and "all predicted yes %" in res.output
    texts = data_out["predictions"]["baseline"]["outputs"]
    assert len(texts) == 4 and all(len(t.split()) <= 1 for t in texts)  # a prefill probe: one token


def test_eval_benchmark_bad_input_is_one_line(tmp_path):
    _one_line_error(_cli("eval", "--task", "pope"), "task 'pope' reads a local copy of the benchmark")
    _one_line_error(_cli("eval", "--task", "pope", "--data", tmp_path / "none"), "benchmark data not found")
    _one_line_error(_cli("eval", "--task", "popee", "--data", tmp_path), "known tasks: demo")
    write_parquet(
        tmp_path / "p" / "data" / "test-00000-of-00001.parquet", [{"question": "q", "answer": "yes"}]
    )
    _one_line_error(_cli("eval", "--task", "pope", "--data", tmp_path / "p"), "column(s) image missing")
    _one_line_error(_cli("eval", "--task", "demo-candidates", "--data", tmp_path / "p"),
                    "--data applies to the benchmarks read from local files")  # fmt: skip
