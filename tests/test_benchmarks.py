"""Every benchmark in benchmarks/ runs its `--quick` mode here (in process: its `main(argv)`), so none can rot,
and what it writes is checked to be real: the rows it should have, the invariants it states (identical picks,
the analytic KV bytes, equal scores, no failed request), and, with a clock whose durations the test sets, the
medians and ratios it reports (known values, not the benchmark's own formula run again)."""

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import need_extra

ROOT = Path(__file__).resolve().parent.parent / "benchmarks"
NOT_BENCHMARKS = {"write_results"}  # `make results` (docs tables from docs/results): tests/test_results_tables.py
ALL = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(name: str, tmp_path, *argv) -> dict:
    out = tmp_path / f"{name}.json"
    ret = bench(name).main(["--quick", "--json", str(out), *map(str, argv)])
    assert ret in (None, 0)
    return json.loads(out.read_text())


def finite_positive(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


def scripted_clock(durations: dict[str, list[float]]) -> SimpleNamespace:
    """A stand-in for a benchmark's `time` module: the interval its loop times for the method named by the
    caller's `name` variable lasts the next of `durations[name]` (two readings per interval: start, end)."""
    state = {"t": 0.0, "open": False}

    def perf_counter() -> float:
        name = sys._getframe(1).f_locals.get("name")
        if name in durations:
            if state["open"]:
                state["t"] += durations[name].pop(0)
            state["open"] = not state["open"]
        return state["t"]

    return SimpleNamespace(perf_counter=perf_counter)


def test_every_benchmark_has_a_quick_mode_and_a_test():
    tested = {n.removeprefix("test_") for n in globals() if n.startswith("test_")}
    for name in ALL:
        src = (ROOT / f"{name}.py").read_text()
        assert '"--quick"' in src and "def main(argv=None)" in src, name
        assert name in tested, f"benchmarks/{name}.py has no test here"
        if "perf_counter" in src:  # it times things: it takes --threads
            assert '"--threads"' in src, name


def test_token_selection(tmp_path):
    """Every reducer (DART too: its stand-in runner computes keys) at 2 sizes x 2 batches; the farthest-point
    loop picks exactly what both plain references pick."""
    mod = bench("token_selection")
    data = run("token_selection", tmp_path)
    rows = data["rows"]
    assert len(rows) == len(mod.METHODS) * 2 * 2
    assert {r["method"] for r in rows} == set(mod.METHODS)
    assert {(r["batch"], r["n"]) for r in rows} == {(1, 144), (1, 256), (2, 144), (2, 256)}
    assert all(finite_positive(r["seconds"], r["peak_bytes"]) for r in rows)
    assert all(math.isfinite(f["time_exponent"]) and math.isfinite(f["memory_exponent"]) for f in data["fits"])
    refs = data["fps_vs_reference"]
    assert [(r["n"], r["k"]) for r in refs] == [(144, math.ceil(0.2 * 144)), (256, math.ceil(0.2 * 256))]
    assert all(r["identical_picks"] for r in refs)


def test_decide_speed(tmp_path):
    """The four methods; trimvlm's answers (no recipe) equal the pipeline's."""
    data = run("decide_speed", tmp_path)
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["pipeline", "trimvlm-alone", "trimvlm-batched", "trimvlm-batched+recipe"]
    for name in ("trimvlm-alone", "trimvlm-batched"):
        assert rows[name]["max_prob_diff"] <= 1e-5 and rows[name]["same_answers"] == 1.0
    assert all(len(r["times_s"]) == 1 for r in rows.values())  # --quick: one round


def test_decide_speed_reports_medians_and_speedups_of_known_times(tmp_path, monkeypatch):
    """Three rounds of set durations: the medians, per-request times and speed-ups are known numbers."""
    mod = bench("decide_speed")
    monkeypatch.setattr(mod, "time", scripted_clock({
        "pipeline": [4.0, 9.0, 1.0], "trimvlm-alone": [2.0, 2.5, 0.5],
        "trimvlm-batched": [1.0, 3.0, 0.1], "trimvlm-batched+recipe": [0.5, 0.4, 8.0]}))  # fmt: skip
    out = tmp_path / "d.json"
    mod.main(["--requests", "2", "--questions", "1", "--rounds", "3", "--json", str(out)])
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert {k: r["median_s"] for k, r in rows.items()} == {
        "pipeline": 4.0, "trimvlm-alone": 2.0, "trimvlm-batched": 1.0, "trimvlm-batched+recipe": 0.5}  # fmt: skip
    assert {k: r["speedup"] for k, r in rows.items()} == {
        "pipeline": 1.0, "trimvlm-alone": 2.0, "trimvlm-batched": 4.0, "trimvlm-batched+recipe": 8.0}  # fmt: skip
    assert rows["pipeline"]["per_request_ms"] == 2000.0  # 4 s over 2 requests


def test_decode_memory(tmp_path):
    """Two contexts; the evicted cache holds the analytic bytes: text + ceil(visual * keep) entries."""
    data = run("decode_memory", tmp_path)
    rows = data["rows"]
    assert [r["visual_tokens"] for r in rows] == [256, 1024]
    per_entry = 2 * 2 * 4 * (64 // 8) * 4  # layers x (K, V) x KV heads x head_dim x fp32
    for r in rows:
        assert r["kv_bytes_baseline"] == per_entry * (r["text_tokens"] + r["visual_tokens"])
        assert r["kv_bytes_evicted"] == r["kv_bytes_analytic"]
        assert r["kv_bytes_evicted"] == per_entry * (r["text_tokens"] + math.ceil(0.25 * r["visual_tokens"]))
        assert finite_positive(r["step_ms_baseline"], r["step_ms_evicted"], r["prefill_s"])


def test_depth_budget(tmp_path):
    """The recipes file: FastV alone and FastV + tail at the one budget, each with its calibration note."""
    out = tmp_path / "matched.yaml"
    bench("depth_budget").main(["--quick", "--out", str(out)])
    text = out.read_text()
    recipes = {r["name"]: r for r in yaml.safe_load(text)["recipes"]}
    assert set(recipes) == {"B75_fastv", "B75_fastv+tail_s1"}
    assert recipes["B75_fastv+tail_s1"]["depth"] == "tail:budget=1:scope=all"
    for r in recipes.values():
        keep = float(r["tokens"].split("keep=")[1].split(":")[0])
        assert 0.01 < keep < 1.0
    notes = [line for line in text.splitlines() if "calibration total FLOPs" in line]
    assert len(notes) == 2
    for line in notes:
        ratio = float(line.split("calibration total FLOPs ")[1].split("x")[0])
        assert abs(ratio - 0.75) <= 0.1, line


def test_fixture_benchmark(tmp_path):
    """A POPE copy in lmms-lab's layout: one parquet shard of 12 rows the POPE loader reads back."""
    import pyarrow.parquet as pq

    out = tmp_path / "pope"
    bench("fixture_benchmark").main(["--quick", "--out", str(out)])
    shards = sorted((out / "data").glob("*.parquet"))
    assert [s.name for s in shards] == ["test-00000-of-00001.parquet"]
    table = pq.read_table(shards[0])
    assert table.num_rows == 12
    assert {"question", "answer", "image"} <= set(table.column_names)
    assert {a.lower() for a in table.column("answer").to_pylist()} <= {"yes", "no"}


def test_prefill_speed(tmp_path):
    """Baseline and prune 75% at L = 0 and 1: the model FLOPs fall as the kept tokens predict."""
    data = run("prefill_speed", tmp_path)
    rows = {r["recipe"]: r for r in data["rows"]}
    assert list(rows) == ["baseline", "tokens=density:prune=0.75:layer=0", "tokens=density:prune=0.75:layer=1"]
    assert data["meta"]["visual_tokens"] == 64  # 128 px / patch 8 / merge 2 = 8 x 8
    base = rows["baseline"]
    assert base["flop_ratio"] == 1.0 and base["method_flops"] == 0
    l0, l1 = rows["tokens=density:prune=0.75:layer=0"], rows["tokens=density:prune=0.75:layer=1"]
    assert l0["prefill_flops"] < l1["prefill_flops"] < base["prefill_flops"]
    assert l0["method_flops"] > 0 and l1["method_flops"] > 0
    for r in rows.values():
        assert finite_positive(r["prefill_ms"], r["speedup"], r["bound"]) and len(r["times_ms"]) == 1


def test_runner_overhead(tmp_path):
    data = run("runner_overhead", tmp_path, "--threads", 1)
    rows = data["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[0]["seq_len"] == rows[1]["seq_len"] > 256  # 256 visual tokens and the prompt
    for r in rows:
        assert finite_positive(r["ours_fwd_s"], r["ref_fwd_s"], r["forward_ratio"], r["generate_ratio"])


def test_runner_overhead_ratios_of_known_times(tmp_path, monkeypatch):
    """With set durations per call the ratios are known: trimvlm's forward 1.5x the model's, generate 1.25x."""
    mod = bench("runner_overhead")
    durations = {"ours_fwd": 3.0, "ref_fwd": 2.0, "ours_gen": 5.0, "ref_gen": 4.0}
    monkeypatch.setattr(mod, "timed", lambda fn: durations[fn.__name__])
    out = tmp_path / "r.json"
    mod.main(["--quick", "--threads", "1", "--json", str(out)])
    for r in json.loads(out.read_text())["rows"]:
        assert (r["ours_fwd_s"], r["ref_fwd_s"]) == (3.0, 2.0)
        assert (r["forward_ratio"], r["generate_ratio"]) == (1.5, 1.25)


def test_scoring_scan(tmp_path, capsys):
    """Two conditions per model: executors agree with `independent`; latencies are medians of the rounds."""
    data = run("scoring_scan", tmp_path, "--threads", 1)
    assert "median of 1 interleaved rounds" in capsys.readouterr().out
    assert "median" in data["timing"]
    rows = data["rows"]
    assert [(r["model"], r["shared"]) for r in rows] == [
        ("qwen3_vl", 0.0), ("qwen3_vl", 0.75), ("qwen3_5", 0.0), ("qwen3_5", 0.75)
    ]  # fmt: skip
    for r in rows:
        assert r["logical_tokens"] == 4 * 9  # 4 candidates x (8 tokens + the close marker)
        assert r["unique_tokens"] == (36 if r["shared"] == 0 else 4 * 3 + 6)  # 6 shared tokens once
        for e in ("independent", "batched", "segments", "tree", "auto"):
            assert r[e]["max_score_error"] <= 1e-4
            assert len(r[e]["latency_rounds_s"]) == 1 and r[e]["latency_s"] > 0  # --quick: one round
        assert r["calls_per_timing"] == 1  # --quick: one call per timing
    assert all(r["tree_plain_layout"] for r in rows if r["shared"] == 0)  # nothing to merge: batched's code
    assert set(data["summary"]) == {"qwen3_vl", "qwen3_5"}


def _scan_row(shared, lat, paired, peaks, plain=False):
    """A scan row with set latencies (independent, batched, segments, tree, auto) and peaks (independent,
    batched)."""
    names = ("independent", "batched", "segments", "tree", "auto")
    row = {"model": "m", "candidates": 4, "suffix_tokens": 8, "shared": shared, "branching": "flat",
           "logical_tokens": 36, "unique_tokens": 36 if shared == 0 else 18, "tree_call_cost_slots": [],
           "calibration_s": 0.0, "tree_over_batched_paired": paired, "tree_plain_layout": plain}  # fmt: skip
    for name, latency in zip(names, lat, strict=True):
        row[name] = {"latency_s": latency, "max_score_error": 1e-6, "peak_branch_bytes": 100}
    row["independent"]["peak_branch_bytes"], row["batched"]["peak_branch_bytes"] = peaks
    return row


def test_scoring_scan_summary_counts_known_conditions():
    """Three conditions with set latencies: the summary's counts are the ones read off by hand."""
    mod = bench("scoring_scan")
    rows = [  # latencies: independent, batched, segments, tree, auto
        _scan_row(0.0, (1.0, 1.0, 0.9, 1.04, 1.2), paired=1.06, peaks=(200, 100), plain=True),  # a plain miss
        _scan_row(0.75, (3.0, 2.0, 2.5, 1.0, 1.05), paired=0.5, peaks=(200, 100)),
        _scan_row(0.5, (1.0, 1.0, 1.1, 1.2, 1.0), paired=1.2, peaks=(100, 150)),
    ]
    s = mod.summary(rows)["m"]
    assert s["conditions"] == 3
    assert s["tree_within_1.05x_batched (ratio of medians)"] == 2  # 1.04 and 0.5 of batched; 1.2 is out
    assert s["tree_within_1.05x_batched (median of paired ratios)"] == 1  # 1.06 and 1.2 are misses
    assert s["misses_where_tree_ran_batched_code"] == 1
    assert s["tree_faster_than_batched"] == 1 and s["segments_faster_than_batched"] == 1
    assert s["batched_peak_below_independent"] == 2
    assert s["auto_within_1.05x_best"] == 2  # 1.2 > 1.05 x min(1.0, 1.04); 1.05 <= 1.05 x 1.0; 1.0 <= 1.05
    assert s["tree_over_batched_median"] == 1.04


def test_serve_load(tmp_path):
    """Both servers answer every cell (2 endpoints x 2 recipes, 2 clients) with no failed request."""
    need_extra("fastapi", "uvicorn", "httpx")
    data = run("serve_load", tmp_path)
    assert data["failed"] == 0
    cells = {(c["server"], c["endpoint"], c["recipe"]) for c in data["cells"]}
    assert len(cells) == len(data["cells"]) == 2 * 2 * 2
    for c in data["cells"]:
        assert c["clients"] == 2 and c["requests"] > 0 and finite_positive(c["throughput_rps"], c["p50_ms"])
        assert c["p99_ms"] >= c["p50_ms"]
    assert len(data["summary"]) == 4 and all(finite_positive(s["ratio"]) for s in data["summary"])


def test_serve_choices(tmp_path):
    """n choices and n separate requests both answered, none failed; n prefills once: 1/n of the FLOPs."""
    need_extra("fastapi", "uvicorn", "httpx")
    data = run("serve_choices", tmp_path)
    assert data["failed"] == 0 and [r["way"] for r in data["rows"]] == ["n", "separate"]
    for r in data["rows"]:
        assert r["units"] > 0 and r["choices"] == 3 * r["units"] and finite_positive(r["choices_per_s"])
    assert data["prefill_flops_ratio"] == pytest.approx(1 / 3)


def test_serve_adaptive(tmp_path):
    """Both servers answer every arrival; the adaptive one's answers ran rungs of its ladder; accuracies are
    graded fractions."""
    need_extra("fastapi", "uvicorn", "httpx")
    data = run("serve_adaptive", tmp_path)
    assert data["failed"] == 0 and [r["server"] for r in data["rows"]] == ["fixed", "adaptive"]
    ladder = {"baseline", "tuned-total_flops=0.85", "tuned-total_flops=0.75", "tuned-total_flops=0.65"}
    fixed, adaptive = data["rows"]
    assert fixed["requests"] > 0 and set(fixed["recipes"]) == {"baseline"} and set(adaptive["recipes"]) <= ladder
    assert all(0 <= r["accuracy"] <= 1 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] for r in data["rows"])


def test_gpu_check(tmp_path, capsys):
    """Without a GPU it says so and does nothing; on a CPU its quick smoke test passes every check."""
    mod = bench("gpu_check")
    if not torch.cuda.is_available():
        none = tmp_path / "none.json"
        assert mod.main(["--json", str(none)]) == 0
        assert "needs a CUDA GPU" in capsys.readouterr().out and not none.exists()
    out = tmp_path / "gpu_check.json"
    assert mod.main(["--device", "cpu", "--quick", "--families", "qwen3_vl", "--dtypes", "float32",
                     "--threads", "1", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    names = [c["name"] for c in data["equivalence"] + data["executors"] + data["noop"]]
    assert "qwen3_vl/float32 prefill logits" in names and "qwen3_vl/float32 greedy tokens" in names
    assert all(c["passed"] for c in data["equivalence"] + data["executors"] + data["noop"])
    assert data["prefill"]["rows"] and data["decode"]["rows"]


def test_serve_cache(tmp_path):
    """The repeated-state workload on both servers: no failed request, every answer of the cached server equal
    to the uncached server's, the cached one reusing prefixes and prepared requests (the uncached one none)."""
    need_extra("fastapi", "uvicorn", "httpx")
    data = run("serve_cache", tmp_path)
    assert data["failed"] == 0 and data["compared"] == data["requests"] and data["mismatches"] == 0
    cached, uncached = data["cells"]
    # per state at most two prefixes: the state's, and a one-question request's (its prompt is its prefix)
    assert cached["server"] == "cached" and cached["prefix_reused"] >= data["requests"] - 2 * data["states"]
    assert cached["request_cached"] > 0 and uncached["prefix_reused"] == uncached["request_cached"] == 0
    assert cached["mean_total_flops"] < uncached["mean_total_flops"]
    assert finite_positive(data["ratio"], cached["p50_ms"], uncached["p50_ms"])


def test_budget_table(tmp_path):
    """The budget table at one budget: the tuned recipe, FastV alone and the naive combination side by side,
    each at its realised total-FLOP ratio (the tuned one within the search's tolerance of the budget)."""
    data = run("budget_table", tmp_path)
    (row,) = data["rows"]
    assert row["budget"] == "B75" and {"tuned", "fastv", "naive"} <= set(row)
    for col in ("tuned", "fastv", "naive"):
        assert 0 <= row[col]["accuracy"] <= 1 and finite_positive(row[col]["total_flops"])
    assert row["tuned"]["total_flops"] <= 0.75 + 0.05
    assert row["fastv"]["spec"].startswith("tokens=fastv:") and "depth=" in row["naive"]["spec"]  # what ran


def test_budget_table_only_replaces_its_rows_of_the_same_draw(tmp_path):
    path = tmp_path / "table.json"
    old = {"model": "m", "items": 600, "seed": 0, "rows": [{"budget": "B75", "v": 1}, {"budget": "B45", "v": 2}]}
    path.write_text(json.dumps(old))
    merged = bench("budget_table")._merged(path, {"model": "m", "items": 600, "seed": 0,
                                                  "rows": [{"budget": "B45", "v": 3}]})  # fmt: skip
    assert merged["rows"] == [{"budget": "B75", "v": 1}, {"budget": "B45", "v": 3}]
    with pytest.raises(SystemExit, match="another table"):
        bench("budget_table")._merged(path, {"model": "m", "items": 600, "seed": 23, "rows": []})


def test_recurrent_branch(tmp_path):
    """Both paths (chunked kernel, recurrent form) x both executors, the same scores (<= 1e-4) and the
    same greedy tokens; the candidate phase really holds less memory in the recurrent form."""
    data = run("recurrent_branch", tmp_path)
    rows = {(r["path"], r["executor"]): r for r in data["rows"]}
    assert set(rows) == {(p, e) for p in ("chunked", "recurrent") for e in ("batched", "tree")}
    assert all(r["suffix_tokens"] == 8 and r["candidates"] == 8 for r in rows.values())
    assert all(r["max_score_diff_vs_chunked"] <= 1e-4 for r in rows.values())
    assert all(finite_positive(r["branch_s"], r["peak_branch_bytes"]) for r in rows.values())
    for ex in ("batched", "tree"):
        assert rows[("recurrent", ex)]["peak_branch_bytes"] < rows[("chunked", ex)]["peak_branch_bytes"]
    assert all(d["same_tokens_as_chunked"] and finite_positive(d["decode_s"]) for d in data["decode"])


def test_token_similarity_known_grids():
    ts = bench("token_similarity")
    g = torch.Generator().manual_seed(0)
    flat = ts.neighbour_stats(torch.ones(12, 4), 3, 4, g)  # every token alike: cos 1 everywhere
    assert all(abs(c - 1) < 1e-6 for c in flat["neighbour"] + flat["random"] + flat["best"])
    assert len(flat["neighbour"]) == 3 * 3 + 2 * 4  # right pairs + down pairs
    e = torch.eye(2)
    checker = torch.stack([e[(r + c) % 2] for r in range(3) for c in range(4)])  # neighbours orthogonal
    stats = ts.neighbour_stats(checker, 3, 4, g)
    assert all(abs(c) < 1e-6 for c in stats["neighbour"] + stats["best"])
    assert set(round(c) for c in stats["random"]) <= {0, 1}


def test_token_similarity(capsys):
    """The quick run on the demo model."""
    ts = bench("token_similarity")
    ts.main(["--quick"])
    out = capsys.readouterr().out
    assert '"images": 4' in out and '"visual_tokens_median": 64' in out


def test_router_oracle(tmp_path):
    """The oracle on 4 demo-scenes items: one row per budget; the oracle answers at least as many items right as
    the unpruned layout and as the oracle held to the router's keep, and stays within its budget."""
    data = run("router_oracle", tmp_path)
    (space,) = data["groups"]
    assert data["items"] == 4 and space["layouts"] == len(space["cost"]) and space["budgets"] == [0.6]
    (row,) = data["rows"]
    assert row["budget"] == 0.6 and row["select"] == space["select"]
    assert row["oracle"]["accuracy"] * 4 >= space["unpruned_right"]
    held = row["oracle_router_keep"]  # out of reach (None) where the router's keep alone costs over the budget
    assert held["accuracy"] is None or row["oracle"]["accuracy"] >= held["accuracy"]
    assert row["oracle"]["mean_cost"] <= 0.6 + 1e-9
