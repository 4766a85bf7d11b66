"""One matrix over every registered method of every axis (tokens, kv, depth), read from the registry: keep = 1
(or an empty layer plan) changes nothing, a ragged batch equals each sample alone, the FLOPs are counted (the
model's and the method's lines add up to torch's FlopCounterMode, the method line > 0 where it computes), every
option has a one-line refusal, and through the server a recipe equals the same recipe in process."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import live, need_extra, plan_prefill, ragged_batch

from trimvlm.cli_calibrate import token_statistics
from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import RecipeError
from trimvlm.plan import make_plan
from trimvlm.registry import REGISTRIES, build_method, load_methods
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.testing import random_image
from trimvlm.vlm import VLM

FAMILY = "qwen3_vl"
AXES = ("tokens", "kv", "depth")
# options that name a file: their values are paths, checked when the plan is made (the file is read there)
PATHS = {"file"}
# methods whose work is element-wise or nothing at all (no matrix product of their own: method line 0)
NO_WORK = {("tokens", "random"), ("tokens", "pool"), ("tokens", "downsample"), ("kv", "random"),
           ("kv", "streamingllm")} | {("depth", n) for n in ("random", "ranking", "skip", "tail")}  # fmt: skip
NO_NOOP = {("depth", "skip")}  # names the layers it skips: no setting skips none


def methods() -> list[tuple[str, str]]:
    load_methods()
    return [(axis, name) for axis in AXES for name in sorted(REGISTRIES[axis])]


IDS = [f"{a}={n}" for a, n in methods()]
NOOPS = [m for m in methods() if m not in NO_NOOP]


@pytest.fixture(scope="module")
def vlm(tiny_adapter):
    torch.set_num_threads(2)
    return VLM(tiny_adapter(FAMILY))


@pytest.fixture(scope="module")
def files(vlm, tmp_path_factory):
    """The files some methods read: a ranking of the tiny model's layers (depth=ranking) and attention
    statistics of two calibration inputs (tokens=fitprune, through the calibrate command's own writer)."""
    n = vlm.runner.num_layers
    folder = tmp_path_factory.mktemp("matrix")
    (folder / "rank.json").write_text(json.dumps({"order": list(range(n - 1, -1, -1)), "num_layers": n,
                                                  "fingerprint": model_fingerprint(vlm.adapter)}))  # fmt: skip
    images, prompts = ragged_batch()
    items = [SimpleNamespace(images=images[b], prompt_text=lambda p=prompts[b]: p) for b in (0, 2)]
    data = token_statistics(vlm, "fitprune", items, 2, {}, "tiny")
    (folder / "fitprune.json").write_text(json.dumps(data))
    return {
        ("depth", "ranking"): f"file={folder / 'rank.json'}",
        ("tokens", "fitprune"): f"file={folder / 'fitprune.json'}",
    }


def spec(axis: str, name: str, files: dict, noop: bool) -> str:
    """The recipe of `axis=name` that reduces (tokens keep 0.25, kv keep 0.5, depth one block skipped in every
    phase), or with `noop` the one that keeps everything."""
    extra = files.get((axis, name))
    if axis == "depth":
        opts = "layers=1" if name == "skip" else f"scope=all:budget={0 if noop else 1}"
    else:
        opts = f"keep={1.0 if noop else 0.25 if axis == 'tokens' else 0.5}"
    return f"{axis}={name}:{opts}" + (f":{extra}" if extra else "")


def _run(vlm, images, prompts, recipe, teacher=None, steps=2):
    """Prefill under the recipe's plan (its KV step included), then `steps` decode steps with the plan's decode
    layers, teacher-forced by `teacher` [B, steps] (None: greedy); (logits [B, steps + 1, V], tokens fed)."""
    plan = make_plan(recipe, vlm.runner)
    prep = vlm.prepare(images, prompts, plan=plan)
    out = vlm.runner.prefill(prep, plan)
    logits, fed, pos = [out.logits], [], out.next_pos.clone()
    for t in range(steps):
        tok = logits[-1].argmax(-1) if teacher is None else teacher[:, t]
        fed.append(tok)
        logits.append(vlm.runner.step(tok[:, None], vlm.adapter.text_positions(pos, 1), out.cache, plan))
        pos += 1
    return torch.stack(logits, 1), torch.stack(fed, 1)


@pytest.mark.parametrize("axis, name", NOOPS, ids=[f"{a}={n}" for a, n in NOOPS])
def test_keep_all_is_an_exact_noop(vlm, files, axis, name):
    images, prompts = ragged_batch()
    prep = vlm.prepare(images, prompts)
    base, bm, _ = plan_prefill(vlm.runner, prep, "", all_logits=True)
    out, m, _ = plan_prefill(vlm.runner, prep, spec(axis, name, files, noop=True), all_logits=True)
    assert torch.equal(out.logits, base.logits)
    assert m.costs.flops == bm.costs.flops and m.costs.method_total_flops == 0
    assert m.costs.kv_bytes == bm.costs.kv_bytes


@pytest.mark.parametrize("axis, name", methods(), ids=IDS)
def test_ragged_batch_equals_each_sample_alone(vlm, files, axis, name):
    images, prompts = ragged_batch()
    images, prompts = images + [[]], prompts + ["what is the colour of a red circle"]  # one without an image
    recipe = spec(axis, name, files, noop=False)
    batch, fed = _run(vlm, images, prompts, recipe)
    for b in range(len(prompts)):
        alone, _ = _run(vlm, images[b : b + 1], prompts[b : b + 1], recipe, teacher=fed[b : b + 1])
        assert (alone[0] - batch[b]).abs().max().item() <= 1e-4, (recipe, b)


@pytest.mark.parametrize("axis, name", methods(), ids=IDS)
def test_flops_add_up_to_torchs_counter(vlm, files, axis, name):
    images, prompts = ragged_batch()
    plan = make_plan(spec(axis, name, files, noop=False), vlm.runner)
    prep = vlm.prepare(images, prompts, plan=plan)
    vlm.runner.vision_flops(prep)  # the vision line is measured once per input shape, outside the run
    with flop_counter() as fc:
        out = generate(vlm.runner, prep, plan, max_new_tokens=2, stop_ids=[], pad_id=0, meter=Meter())
    c = out.costs
    assert c.model_flops + c.method_total_flops == c.total_flops == fc.get_total_flops()
    assert (c.method_total_flops == 0) == ((axis, name) in NO_WORK)


def _bad_options(axis: str, name: str) -> list[str]:
    cls = REGISTRIES[axis][name]
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in PATHS]


@pytest.mark.parametrize("axis, name", methods(), ids=IDS)
def test_every_option_has_a_one_line_refusal(files, axis, name):
    base = {"keep": 0.5} if axis != "depth" else {}
    if (axis, name) in files:
        key, value = files[(axis, name)].split("=", 1)
        base[key] = value
    with pytest.raises(RecipeError) as e:
        build_method(axis, name, {**base, "bogus": 1})
    assert "allowed" in str(e.value) and "\n" not in str(e.value)
    for option in _bad_options(axis, name):
        with pytest.raises(RecipeError) as e:
            build_method(axis, name, {**base, option: "zzz"})
        msg = str(e.value)
        assert "\n" not in msg and (option in msg or "allowed" in msg), (option, msg)


# ---- through the server (the serve extra): a few recipes, one of each kind ---------------------------------
SERVED = ["tokens=pyramiddrop:keep=0.25", "tokens=vispruner:keep=0.25", "tokens=gprune:keep=0.25",
          "tokens=fastervlm:keep=0.25", "kv=pyramidkv:keep=0.5", "depth=skip:layers=1"]  # fmt: skip


@pytest.fixture(scope="module")
def server(demo):
    need_extra("fastapi", "uvicorn", "httpx")
    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.state import ServerState

    state = ServerState(demo, model_id="demo", caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))
    with live(state) as (url, _):
        yield url


@pytest.mark.parametrize("recipe", SERVED)
def test_a_recipe_through_the_server_equals_it_in_process(demo, server, recipe):
    import base64
    import io

    import httpx

    image = random_image(4, (96, 96))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe ?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "recipe": recipe}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=300)
    ref = demo.generate(image, "describe ?", recipe=recipe, max_new_tokens=4)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["message"]["content"] == ref.texts[0]
    assert got["usage"]["method_flops"] == ref.costs.method_total_flops
    assert got["usage"]["prefill_flops"] == ref.costs.flops["prefill"]
