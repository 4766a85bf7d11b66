"""`trimvlm eval --ray`: the demo task sharded over a local Ray instance with 2 CPU workers (started here) gives
the single-process results (same per-item predictions, same summed FLOPs and KV bytes per group); an
address nobody answers on fails within seconds; bad --workers values are refused. Needs Ray (`make ray`)."""

import json

import pytest
import torch
from conftest import optional

from trimvlm.testing.cli import assert_one_line_error as _one_line_error
from trimvlm.testing.cli import run_cli as _cli

ray, needs_ray = optional("ray", "`make ray` installs trimvlm[ray]")
pytestmark = pytest.mark.own_process  # a Ray driver's threads stay in its process: a child pytest's (own_process.py)

RECIPES = ["tokens=density:keep=0.5:layer=3", "kv=density:keep=0.25"]
LIMIT, BATCH = 24, 4  # 6 kinds x 4 items: 6 batches, cut into shards of consecutive batches
EXACT = ("prefill_flops", "decode_flops", "method_flops", "total_flops", "kv_bytes")






@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@needs_ray
def test_tune_over_ray_gives_the_single_process_frontier(local_ray, tmp_path):
    import trimvlm
    from trimvlm.integrations.ray_eval import RayEvaluator
    from trimvlm.tune import Settings, search

    torch.set_num_threads(1)
    space = tmp_path / "space.yaml"
    space.write_text("tokens:\n  - {method: fastv, layer: [2]}\n  - {method: random, layer: [0]}\n"
                     "kv:\n  - {method: snapkv, keep: [0.5]}\ncombine: [tokens, tokens+kv]\n")  # fmt: skip
    kw = {"n_val": 16, "n_test": 12, "settings": Settings(start=8, batch_size=8), "progress": False, "space": space}
    budgets = ["total_flops=0.8", "total_flops=0.6"]
    vlm = trimvlm.load("demo")
    one = search.tune(vlm, "demo", budgets, out=tmp_path / "one", **kw)
    with RayEvaluator("demo", workers=2, progress=False) as ev:
        sharded = search.tune(vlm, "demo", budgets, out=tmp_path / "ray", evaluate=ev, **kw)
        assert len(ev.actors) == 2
    assert one["frontier"]["total_flops"] == sharded["frontier"]["total_flops"]
    assert [b["ranking"] for b in one["budgets"]] == [b["ranking"] for b in sharded["budgets"]]
    acc = {e["spec"]: e["test"]["accuracy"] for e in one["entries"] if "test" in e}
    assert acc and acc == {e["spec"]: e["test"]["accuracy"] for e in sharded["entries"] if "test" in e}
    # the CLI: --workers without --ray is refused
    _one_line_error(_cli("tune", "--budget", "total_flops=0.8", "--workers", 2), "--workers applies to a search")


@needs_ray
def test_ray_run_equals_single_process(local_ray, tmp_path):
    import trimvlm
    from trimvlm.evals.run import run_eval

    torch.set_num_threads(1)
    out = tmp_path / "ray.json"
    args = ["eval", "--model", "demo", "--task", "demo", "--limit", LIMIT, "--batch-size", BATCH,
            "--json", out]  # fmt: skip
    for r in RECIPES:
        args += ["--recipe", r]
    res = _cli(*args, "--ray", "auto", "--workers", 2)  # auto: the Ray instance this process runs
    assert res.exit_code == 0, res.output
    assert "on 2 Ray workers" in res.output  # the progress bar over the shards
    got = json.loads(out.read_text())
    ref = run_eval(trimvlm.load("demo"), "demo", RECIPES, limit=LIMIT, batch_size=BATCH, progress=False)

    for label, texts in zip(ref.labels, ref.predictions, strict=True):
        assert got["predictions"][label]["outputs"] == texts, label
    assert len(got["results"]) == len(ref.rows)
    for a, b in zip(got["results"], ref.rows, strict=True):
        assert (a["recipe"], a["group"], a["n"]) == (b["recipe"], b["group"], b["n"])
        assert a["accuracy"] == b["accuracy"] and a["mismatch_pct"] == b["mismatch_pct"]
        assert a["costs"]["batches"] == b["costs"]["batches"]
        for k in EXACT:  # costs summed per item over the same batches
            assert a["costs"]["sum"][k] == b["costs"]["sum"][k], (a["recipe"], a["group"], k)
            assert a["ratio"][k] == b["ratio"][k]
    info = got["settings"]["ray"]
    assert info["workers"] == 2 and len({s["worker"]["pid"] for s in info["shards"]}) == 2
    assert sum(s["items"] for s in info["shards"]) == LIMIT
    assert got["settings"]["order"] == ref.settings["order"]
    # more workers than the cluster has CPUs: refused before any worker starts (not a wait for resources)
    _one_line_error(_cli("eval", "--limit", 6, "--ray", "auto", "--workers", 3),
                    "3 workers need 3 CPUs (one each) but the Ray cluster")  # fmt: skip


@needs_ray
def test_shards_regroup_into_the_single_process_batches():
    from trimvlm.evals.run import batches
    from trimvlm.evals.tasks import get_task
    from trimvlm.integrations.ray_eval import shards_of

    task = get_task("demo", limit=50)
    whole = batches(task, 4)
    for n in (1, 3, 7, 100):
        shards = shards_of(task, 4, n)
        assert len(shards) <= n
        assert sum(k for _, _, k in shards) == len(whole)
        assert [i for idx, _, _ in shards for i in idx] == [i for b in whole for i in b]
        assert [first for _, first, _ in shards] == [
            sum(k for _, _, k in shards[:j]) for j in range(len(shards))
        ]


@needs_ray
@pytest.mark.parametrize("address", ["127.0.0.1:9", "10.255.255.1:6379"])
def test_unreachable_ray_address_fails_fast(address):
    """A closed port is refused at once; a non-routable address times out in the 3 s TCP probe, or, where a
    proxy accepts every connection (this sandbox answers HTTP/2 on it), ray.init gives up after its
    bounded retries (~5 s instead of Ray's 20)."""
    assert not ray.is_initialized()
    res = _cli("eval", "--model", "demo", "--limit", 6, "--ray", address, "--workers", 2)
    _one_line_error(res, f"cannot reach the Ray cluster at {address}")
    assert not ray.is_initialized()  # no local cluster was started instead, nothing left connected


@needs_ray
def test_bad_ray_arguments():
    _one_line_error(_cli("eval", "--limit", 6, "--ray", "nowhere"), "is not HOST:PORT")


@pytest.mark.parametrize("workers", [0, -2])
def test_workers_must_be_positive(workers):
    _one_line_error(_cli("eval", "--limit", 6, "--ray", "local", "--workers", workers),
                    "workers must be a positive number of Ray workers")  # fmt: skip


def test_workers_need_ray():
    _one_line_error(_cli("eval", "--limit", 6, "--workers", 2), "--workers applies to a run sharded over Ray")
