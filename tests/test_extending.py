"""docs/extending.md followed literally: its example method file is taken from the page, dropped into the tokens
package (through a temporary folder on the package's path, removed afterwards), listed by `trimvlm methods` and
run on the demo model: keep = 1 changes nothing, a ragged batch equals each sample alone, a lower keep keeps fewer
tokens, and its work is on the method's FLOP line."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import plan_prefill

import trimvlm.tokens
from trimvlm import protocol
from trimvlm.demo.task import make_sample, split_rng
from trimvlm.registry import REGISTRIES, load_methods

PAGE = Path(__file__).resolve().parent.parent / "docs" / "extending.md"
# "The whole of `src/trimvlm/tokens/NAME.py`:" and the python block right after it
EXAMPLE = re.compile(r"The whole of\s+`src/trimvlm/tokens/(\w+)\.py`:\n\n```python\n(.*?)\n```", re.S)


def page_example() -> tuple[str, str]:
    found = EXAMPLE.findall(PAGE.read_text())
    assert len(found) == 1, "docs/extending.md must show exactly one complete token method file"
    return found[0]


@pytest.fixture
def dropped_in(tmp_path, monkeypatch):
    """The page's file in a temporary folder on `trimvlm.tokens.__path__`, methods loaded as in a fresh process;
    the path, the registry and the imported module restored afterwards."""
    name, code = page_example()
    load_methods()
    for axis, reg in REGISTRIES.items():
        monkeypatch.setitem(REGISTRIES, axis, dict(reg))
    (tmp_path / f"{name}.py").write_text(code + "\n")
    monkeypatch.setattr(trimvlm.tokens, "__path__", [*trimvlm.tokens.__path__, str(tmp_path)])
    monkeypatch.setattr(protocol, "_loaded", False)
    yield name
    sys.modules.pop(f"trimvlm.tokens.{name}", None)
    if hasattr(trimvlm.tokens, name):
        delattr(trimvlm.tokens, name)


def test_the_page_shows_one_file_that_registers_one_method():
    name, code = page_example()
    load_methods()
    assert f'@register("tokens", "{name}")' in code
    assert name not in REGISTRIES["tokens"]  # a new method, not one trimvlm ships


def _scene(seed: int):
    return make_sample(split_rng("test", seed)).image


def _kept(out) -> list[int]:
    return (out.seq.visual & out.seq.valid).sum(1).tolist()


def test_the_pages_method_is_listed_and_runs(dropped_in, demo, tmp_path):
    from typer.testing import CliRunner

    from trimvlm.cli import app

    name = dropped_in
    res = CliRunner().invoke(app, ["methods", "--json", str(tmp_path / "methods.json")])
    assert res.exit_code == 0, res.output
    listed = {m["name"]: m for m in json.loads((tmp_path / "methods.json").read_text())["tokens"]}
    assert name in listed and listed[name]["summary"].startswith("NormKeep: keep the visual tokens")
    assert {o["name"]: o["default"] for o in listed[name]["options"]}["smallest"] is False
    assert REGISTRIES["tokens"][name].__module__ == f"trimvlm.tokens.{name}"

    runner, adapter = demo.runner, demo.adapter
    # a ragged batch: one, two and no images, prompts of different lengths
    images = [[_scene(1)], [_scene(2), _scene(3)], []]
    prompts = ["how many red shapes ?", "which shape is left of the blue circle ?", "what colour ?"]
    prep = adapter.prepare(images, prompts)
    base, base_meter, _ = plan_prefill(runner, prep, "", all_logits=True)
    same, same_meter, _ = plan_prefill(runner, prep, f"tokens={name}:keep=1.0", all_logits=True)
    assert torch.equal(same.logits, base.logits)
    assert same_meter.costs.flops["prefill"] == base_meter.costs.flops["prefill"]

    n = _kept(base)  # visual tokens per sample
    per_image = n[0]
    assert n == [per_image, 2 * per_image, 0]
    kept = {}
    for keep in (0.5, 0.25):
        out, meter, _ = plan_prefill(runner, prep, f"tokens={name}:keep={keep}")
        kept[keep] = _kept(out)
        k = math.ceil(per_image * keep)
        assert kept[keep] == [k, 2 * k, 0]
        assert meter.costs.flops["prefill"] < base_meter.costs.flops["prefill"]
        hidden = adapter.text_config.hidden_size
        assert meter.costs.method_flops["prefill"] == 2 * 3 * per_image * hidden  # s_i = x_i . x_i, 3 images
    assert kept[0.25] != kept[0.5]

    recipe = f"tokens={name}:keep=0.3"
    out, _, _ = plan_prefill(runner, prep, recipe)
    for b in range(len(prompts)):
        alone, _, _ = plan_prefill(runner, adapter.prepare(images[b : b + 1], prompts[b : b + 1]), recipe)
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4

    largest, _, _ = plan_prefill(runner, prep, f"tokens={name}:keep=0.25")
    smallest, _, _ = plan_prefill(runner, prep, f"tokens={name}:keep=0.25:smallest=true")
    assert not torch.equal(largest.seq.source, smallest.seq.source)  # the option picks other tokens
