"""Budgets that follow the load (`--tuned DIR --slo-ttft-ms T`): the ladder is the baseline then the tuned
budget points' recipes, most expensive first; a request that names no recipe takes the most accurate rung
whose predicted TTFT fits T (the prediction is set here, never timed); the answer is what `vlm.generate` gives
with that recipe, `usage.recipe` names it, /metrics counts requests per recipe, and a request's own recipe
wins. The engine's prefills and steps feed the prediction."""

import json
import math

import pytest
from conftest import live, need_extra

need_extra("fastapi", "uvicorn", "httpx", "prometheus_client")

import httpx  # noqa: E402

from trimvlm.errors import InputError  # noqa: E402
from trimvlm.serve.budgets import WINDOW_S, LoadBudget, Rung, ladder  # noqa: E402
from trimvlm.serve.recipes import RecipeOptions  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402

from test_serve_engine import image, messages  # noqa: E402  isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # (the demo model: conftest's `demo`)


def tune_folder(folder, demo):
    """A folder as `trimvlm tune --out` writes it: two budget points (pool at 50% and 25%)."""
    from trimvlm.depth.base import model_fingerprint

    folder.mkdir(exist_ok=True)
    entries = [{"spec": "baseline", "recipe": {}, "test": {"accuracy": 0.99, "ratio": {"prefill_flops": 1.0}}},
               {"spec": "pool50", "recipe": {"tokens": "pool:keep=0.5"},
                "test": {"accuracy": 0.9, "ratio": {"prefill_flops": 0.55, "latency_s": 0.6}}},
               {"spec": "pool25", "recipe": {"tokens": "pool:keep=0.25"},
                "test": {"accuracy": 0.8, "ratio": {"prefill_flops": 0.4}}}]  # fmt: skip
    budgets = [{"label": "total_flops=0.4", "budget": {"total_flops": 0.4}, "best": "pool25"},
               {"label": "total_flops=0.6", "budget": {"total_flops": 0.6}, "best": "pool50"}]  # fmt: skip
    rep = {"fingerprint": model_fingerprint(demo.adapter), "entries": entries, "budgets": budgets}
    (folder / "tune.json").write_text(json.dumps(rep))
    return folder


def test_the_ladder_is_most_expensive_first(demo, tmp_path):
    rungs = ladder(tune_folder(tmp_path / "t", demo))
    assert [(r.label, r.ratio, r.accuracy) for r in rungs] == [  # the measured latency ratio, else FLOPs
        ("baseline", 1.0, 0.99), ("tuned-total_flops=0.6", 0.6, 0.9), ("tuned-total_flops=0.4", 0.4, 0.8)]
    with pytest.raises(InputError, match="no tune.json"):
        ladder(tmp_path)


def test_the_rung_chosen_is_the_most_accurate_that_fits():
    rungs = [Rung("", "baseline", 1.0, None), Rung("a", "a", 0.6, None), Rung("b", "b", 0.4, None)]
    load = LoadBudget(rungs, slo_s=0.25)
    assert load.choose(50) is rungs[0]  # nothing measured yet: every prediction is 0
    load.tokens, load.s_per_token, load.step_s = 100, 0.001, 0.01  # 0.1 s per baseline prompt
    assert load.predict(rungs[0], 0) == pytest.approx(0.11)
    assert [load.choose(w).label for w in (0, 1, 2, 3, 5, 9)] == ["baseline", "baseline", "a", "a", "b", "b"]
    # at 1 request/s the baseline is busy 10% of the time and the 99th-percentile wait (M/D/1's exponential
    # tail) is 0.1 / (2 * 0.9) * ln(0.1 / 0.01) = 0.128 s: with the prefill and a step, 0.238 s <= 0.25
    assert load.sustained(rungs[0], 1) == pytest.approx(0.1 / 1.8 * math.log(10) + 0.11)
    assert load.sustained(rungs[1], 17) == math.inf  # 17 x 0.06 s of work a second: more than the engine has
    assert [load.choose(0, rate).label for rate in (0, 0.5, 1, 2, 6, 8, 30)] == [
        "baseline", "baseline", "baseline", "a", "a", "b", "b"]
    load.decode_s = 0.02  # each request also takes 20 ms of decode steps: 0.12 s of engine time on the baseline
    assert load.sustained(rungs[0], 1) == pytest.approx(0.12 / 1.76 * math.log(12) + 0.11)  # 0.279 s
    assert load.choose(0, 1).label == "a"
    assert load.choose(0, 4).label == "b"  # a: rho = 0.32, 0.08 / 1.36 * ln(32) + 0.07 = 0.274 s
    load.prefilled("a", 2, 200, 0.12)  # 0.12 s for 200 tokens at 60%: 0.001 s per baseline token
    assert load.s_per_token == pytest.approx(0.001) and load.tokens == pytest.approx(100)
    assert load.decode_s == pytest.approx(0.8 * 0.02)  # no decode step ran before that prefill
    load.stepped(0.01), load.stepped(0.03)  # two decode steps, then a prefill of 2 requests: 0.02 s each
    load.prefilled("a", 2, 200, 0.12)
    assert load.decode_s == pytest.approx(0.8 * 0.016 + 0.2 * 0.02) and load.step_s > 0.01
    with pytest.raises(InputError, match="slo-ttft-ms"):
        LoadBudget(rungs, 0)


def test_the_arrival_rate_is_of_the_last_window():
    load = LoadBudget([Rung("", "baseline", 1.0, None)], slo_s=0.25)
    assert load.rate(now=100.0) == 0
    for t in range(40):  # 10 requests a second for 4 s
        load.arrived(now=100.0 + t / 10)
    assert load.rate(now=103.95) == pytest.approx(20 / 1.95)  # the last 2 s: 20 requests, from 102.0 on
    assert load.rate(now=110.0) == 0  # nothing came for longer than the window
    for t in range(6):  # after the quiet spell, 10 a second again: seen at once, not over the whole window
        load.arrived(now=110.0 + t / 10)
    assert load.rate(now=110.5) == pytest.approx(6 / (WINDOW_S / 4))  # 6 in 0.5 s


def test_requests_follow_the_load_and_their_own_recipe_wins(demo, tmp_path, monkeypatch):
    folder = tune_folder(tmp_path / "t", demo)
    state = ServerState(demo, model_id="demo", recipes=RecipeOptions(tuned=folder, slo_ttft_ms=200))
    predicted = {"baseline": 1.0, "tuned-total_flops=0.6": 0.5, "tuned-total_flops=0.4": 0.1}  # seconds
    monkeypatch.setattr(state.load, "predict", lambda rung, waiting: predicted[rung.label])
    monkeypatch.setattr(state.load, "sustained", lambda rung, rate: 0.0)

    def ask(url, **kw):
        body = {"messages": messages(3), "max_tokens": 12} | kw
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()

    with live(state) as (url, _):
        busy = ask(url)
        predicted["tuned-total_flops=0.6"] = 0.15  # the queue got shorter: the 60% rung fits
        calmer = ask(url)
        own = ask(url, recipe="baseline")
        metrics = httpx.get(url + "/metrics").text
    assert busy["usage"]["recipe"] == "tuned-total_flops=0.4"
    assert calmer["usage"]["recipe"] == "tuned-total_flops=0.6"
    assert own["usage"]["recipe"] == "baseline"
    for got, keep in ((busy, 0.25), (calmer, 0.5)):
        ref = demo.generate(image(3), "describe ?", recipe=f"tokens=pool:keep={keep}", max_new_tokens=12)
        assert got["choices"][0]["message"]["content"] == ref.texts[0]
        assert got["usage"]["prefill_flops"] == ref.costs.flops["prefill"]
    for label in predicted:
        assert f'trimvlm_chat_requests_by_recipe_total{{recipe="{label}"}} 1.0' in metrics
    assert state.load.s_per_token > 0 and state.load.step_s > 0  # the engine told it what ran
    assert state.load.tokens == pytest.approx(own["usage"]["prompt_tokens"])


def test_tuned_and_the_objective_go_together(demo, tmp_path):
    with pytest.raises(InputError, match="go together"):
        ServerState(demo, model_id="demo", recipes=RecipeOptions(tuned=tune_folder(tmp_path / "t", demo)))
