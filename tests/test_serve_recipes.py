"""Every recipe the chat route accepts runs as it does in process, or is refused: each registered token reducer,
KV policy and depth method through /v1/chat/completions equals `vlm.generate` with the same recipe (answer and
FLOPs), on a prompt prefilled whole and on one longer than `--max-prefill-tokens` (prefilled in chunks where the
plan allows). A client's recipe never reads a server path: tuned= names a folder inside `--recipe-dir` only."""

import json

import pytest
from conftest import hand_flops, live, need_extra

need_extra("fastapi", "uvicorn", "httpx")

import httpx  # noqa: E402

from trimvlm.errors import TrimVLMError  # noqa: E402
from trimvlm.registry import REGISTRIES, load_methods  # noqa: E402
from trimvlm.serve.limits import CacheSizes, ServerLimits  # noqa: E402
from trimvlm.serve.recipes import RecipeOptions  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (the demo model: conftest's `demo`)

MAX_TOKENS = 6
OPTIONS = {"tokens": "keep=0.25", "kv": "keep=0.5", "depth": "scope=all:budget=1"}
SPECIAL = {"depth=skip": "depth=skip:layers=1", "tokens=downsample": "tokens=downsample:keep=0.25"}


def recipes() -> list[str]:
    load_methods()
    out = []
    for axis in ("tokens", "kv", "depth"):
        for name in sorted(REGISTRIES[axis]):
            out.append(SPECIAL.get(f"{axis}={name}", f"{axis}={name}:{OPTIONS[axis]}"))
    return out


def _image():
    import numpy as np

    from trimvlm.demo.task import make_scene, render

    return render(make_scene(np.random.default_rng(5)))


def _url(im) -> str:
    import base64
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(url: str, recipe: str) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": _url(_image())}}, {"type": "text", "text": "describe ?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "recipe": recipe}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def servers(demo):
    """Two servers over the demo model, caches off (every request computes all it costs): one prefills the
    prompt (~70 tokens) whole, one in chunks of 16."""
    whole = ServerState(demo, model_id="demo", caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))
    chunked = ServerState(demo, model_id="demo", limits=ServerLimits(max_prefill_tokens=16), caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))  # fmt: skip
    with live(whole) as (a, _), live(chunked) as (b, _):
        yield {"whole": (a, whole), "chunked": (b, chunked)}


@pytest.mark.parametrize("recipe", recipes())
def test_every_method_through_chat_equals_generate(demo, servers, recipe):
    try:
        ref = demo.generate(_image(), "describe ?", recipe=recipe, max_new_tokens=MAX_TOKENS)
    except TrimVLMError as e:  # the demo model cannot run it: the server refuses it too
        for url, _ in servers.values():
            r = _ask(url, recipe)
            assert r.status_code == 400 and "recipe" in r.text, (r.status_code, r.text, str(e))
        return
    c = ref.costs
    for mode, (url, state) in servers.items():
        chunks = state.batcher.engine.chunks
        r = _ask(url, recipe)
        assert r.status_code == 200, r.text
        got = r.json()
        u = got["usage"]
        assert got["choices"][0]["message"]["content"] == ref.texts[0], (mode, recipe)
        assert u["recipe"] == ref.recipe and u["completion_tokens"] == len(ref.tokens[0])
        assert u["vision_flops"] == c.flops.get("vision", 0), (mode, recipe)
        assert u["decode_flops"] == c.decode_flops and u["method_flops"] == c.method_total_flops, (mode, recipe)
        ran_chunked = state.batcher.engine.chunks > chunks
        if not ran_chunked:
            assert u["prefill_flops"] == c.flops["prefill"], (mode, recipe)
            continue
        # chunks attend to what the cache holds and causally within themselves: the linear work is the same,
        # the attention's less (at most its whole share: QK^T and AV of every layer over the prompt)
        assert mode == "chunked"
        cfg = demo.adapter.text_config
        s = u["prompt_tokens"]
        share = hand_flops(cfg, 1, s, s, cfg.num_hidden_layers) - hand_flops(cfg, 1, s, 0, cfg.num_hidden_layers)
        assert 0 <= c.flops["prefill"] - u["prefill_flops"] <= share, (recipe, c.flops["prefill"], u["prefill_flops"])


def test_downsample_changes_the_answer_costs_and_runs_chunked(demo, servers):
    """The case that ran as the baseline: tokens=downsample prepares the images smaller (fewer prompt tokens,
    fewer vision FLOPs) and is chunkable: the chunked server prefills it in chunks."""
    base = demo.generate(_image(), "describe ?", max_new_tokens=MAX_TOKENS)
    ref = demo.generate(_image(), "describe ?", recipe=SPECIAL["tokens=downsample"], max_new_tokens=MAX_TOKENS)
    assert ref.costs.flops["vision"] < base.costs.flops["vision"]
    url, state = servers["chunked"]
    chunks = state.batcher.engine.chunks
    u = _ask(url, SPECIAL["tokens=downsample"]).json()["usage"]
    assert state.batcher.engine.chunks > chunks
    assert u["vision_flops"] == ref.costs.flops["vision"]
    assert u["prompt_tokens"] == int(demo.prepare(_image(), "describe ?").attention_mask.sum()) - 64 + 16


def test_the_runner_refuses_a_batch_prepared_at_another_resolution(demo):
    from trimvlm.plan import make_plan
    from trimvlm.recipe import parse_recipe

    plan = make_plan(parse_recipe(SPECIAL["tokens=downsample"]), demo.runner)
    prepared = demo.prepare(_image(), "describe ?")  # not at the plan's resolution
    with pytest.raises(TrimVLMError, match="resolution"):
        demo.runner.prefill(prepared, plan)
    with pytest.raises(TrimVLMError, match="resolution"):
        demo.runner.prefill_chunked(prepared, plan)
    with pytest.raises(TrimVLMError, match="resolution"):  # and the other way round
        demo.runner.prefill_chunked(demo.prepare(_image(), "describe ?", plan=plan), make_plan(None, demo.runner))


@pytest.fixture
def reads(monkeypatch):
    """Every path the recipe parser opens or asks about (Path.exists, is_dir, read_text, open)."""
    from pathlib import Path

    seen = []
    for name in ("exists", "is_dir", "is_file", "read_text"):
        real = getattr(Path, name)

        def spy(self, *a, _real=real, **kw):
            seen.append(str(self))
            return _real(self, *a, **kw)

        monkeypatch.setattr(Path, name, spy)
    return seen


@pytest.mark.parametrize("recipe", ["tuned=/etc:budget=0.5", "tuned=../../etc:budget=0.5", "/etc/recipe.yaml",
                                    "tokens=pool:keep=0.5,depth=ranking:file=/etc/passwd"])  # fmt: skip
def test_a_clients_recipe_never_reads_a_server_path(demo, tmp_path, reads, recipe):
    from trimvlm.serve.errors import ApiError

    for folder in (None, tmp_path):
        state = ServerState(demo, model_id="demo", recipes=RecipeOptions(recipe_dir=folder))
        reads.clear()
        with pytest.raises(ApiError) as e:
            state.recipes.get("chat", recipe)
        assert e.value.status == 400 and "recipe" in str(e.value.body())
        assert not [p for p in reads if "etc" in p], reads
        assert "not found" not in json.dumps(e.value.body())  # nothing says whether a path exists


def test_recipe_dir_lets_clients_name_tuned_folders_inside_it(demo, tmp_path):
    from trimvlm.depth.base import model_fingerprint
    from trimvlm.serve.errors import ApiError

    folder = tmp_path / "fast"
    folder.mkdir()
    entry = {"spec": "pool", "recipe": {"tokens": "pool:keep=0.25"}}
    rep = {"fingerprint": model_fingerprint(demo.adapter), "entries": [entry],
           "budgets": [{"label": "total_flops<=0.5", "budget": {"total_flops": 0.5}, "best": "pool"}]}  # fmt: skip
    (folder / "tune.json").write_text(json.dumps(rep))
    state = ServerState(demo, model_id="demo", recipes=RecipeOptions(recipe_dir=tmp_path))
    got = state.recipes.get("chat", "tuned=fast:budget=0.5")
    assert got.recipe.tokens.method == "pool" and got.label == "tuned-total_flops<=0.5"
    with pytest.raises(ApiError) as e:  # a name inside the folder that is not there: its name, not the path
        state.recipes.get("chat", "tuned=slow:budget=0.5")
    assert e.value.status == 400 and str(tmp_path) not in json.dumps(e.value.body())
    with pytest.raises(ApiError):
        ServerState(demo, model_id="demo").recipes.get("chat", "tuned=fast:budget=0.5")  # no --recipe-dir: refused


@pytest.mark.parametrize("recipe", ["kv=snapkv:keep=0.5", "tokens=density:keep=0.25:layer=1", "depth=skip:layers=1",
                                    SPECIAL["tokens=downsample"]])  # fmt: skip
def test_n_choices_under_a_recipe_equal_generate(demo, servers, recipe):
    """n = 3 sampled choices off one prefill under a token reducer, a KV policy, a layer plan and downsample:
    choice i equals vlm.generate with seed + i, and the prefill is one request's."""
    url, _ = servers["whole"]
    content = [{"type": "image_url", "image_url": {"url": _url(_image())}}, {"type": "text", "text": "describe ?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "n": 3,
            "temperature": 1.0, "seed": 2, "recipe": recipe}  # fmt: skip
    got = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    refs = [demo.generate(_image(), "describe ?", recipe=recipe, max_new_tokens=MAX_TOKENS, temperature=1.0,
                          seed=2 + i) for i in range(3)]  # fmt: skip
    assert [c["message"]["content"] for c in got["choices"]] == [r.texts[0] for r in refs]
    assert got["usage"]["prefill_flops"] == refs[0].costs.flops["prefill"]
