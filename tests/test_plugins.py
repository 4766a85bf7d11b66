"""Methods come from the axis packages' files and from installed packages (entry-point group `trimvlm.methods`):
a tiny plugin package installed into a fresh interpreter is listed by `trimvlm methods` and runs in a recipe; a
plugin that fails to load, or a method name registered twice, gets one line that names it."""

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from conftest import declared_methods

import trimvlm
from trimvlm import protocol
from trimvlm.errors import PluginError, RecipeError
from trimvlm.registry import REGISTRIES, load_methods, register

SRC = Path(trimvlm.__file__).resolve().parent


PLUGIN_TOKENS = '''
"""Plug-first: keep the first K visual tokens of each image, in grid order (a test plugin)."""

from dataclasses import dataclass

from trimvlm.kernels.select import topk_mask
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "plug-first")
@dataclass
class First(TokenReducer):
    def choose(self, view: VisualView) -> Selection:
        return Selection(keep=topk_mask(-view.cells.float(), view.k, view.mask))
'''

PLUGIN_DEPTH = '''
"""Plug-skip: skip the block before the last one (a test plugin, registered by a callable)."""

from dataclasses import dataclass

from trimvlm.depth.base import DepthMethod
from trimvlm.protocol import register


@dataclass
class SkipSecondLast(DepthMethod):
    def skipped(self, runner) -> frozenset[int]:
        return frozenset({runner.num_layers - 2})


def install() -> None:
    register("depth", "plug-skip")(SkipSecondLast)
'''

# the driver runs in a fresh interpreter that sees the plugin: the CLI as a user types it, in one process
DRIVER = """
import json, sys
from typer.testing import CliRunner
from trimvlm.cli import app

out = sys.argv[1]
runs = {
    "methods": ["methods", "--json", f"{out}/methods.json"],
    "image": ["demo-image", f"{out}/scene.png"],
    "base": ["generate", "--image", f"{out}/scene.png", "--prompt", "how many red shapes ?", "--max-new-tokens", "2",
             "--json", f"{out}/base.json"],
    "plugin": ["generate", "--image", f"{out}/scene.png", "--prompt", "how many red shapes ?", "--max-new-tokens",
               "2", "--recipe", "tokens=plug-first:keep=0.25:layer=0,depth=plug-skip", "--json", f"{out}/plugin.json"],
}
codes = {}
for name, args in runs.items():
    res = CliRunner().invoke(app, args)
    codes[name] = [res.exit_code, res.output[-2000:]]
json.dump(codes, open(f"{out}/codes.json", "w"))
"""


def install_plugin(site: Path) -> None:
    """A package with two entry points in group trimvlm.methods (a module, a callable), as pip would lay it out."""
    pkg = site / "trimvlm_plugdemo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "first.py").write_text(PLUGIN_TOKENS)
    (pkg / "skip.py").write_text(PLUGIN_DEPTH)
    info = site / "trimvlm_plugdemo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trimvlm-plugdemo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[trimvlm.methods]\nfirst = trimvlm_plugdemo.first\nskip = trimvlm_plugdemo.skip:install\n"
    )


def test_an_installed_package_adds_methods(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    install_plugin(site)
    out.mkdir()
    (tmp_path / "driver.py").write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC.parent), str(site)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads((out / "codes.json").read_text())
    assert {name: code for name, (code, _) in codes.items()} == dict.fromkeys(codes, 0), codes
    listed = json.loads((out / "methods.json").read_text())
    names = {axis: {m["name"] for m in ms} for axis, ms in listed.items()}
    # a fresh interpreter finds every built-in method by discovery, and the plugin's two beside them
    want = declared_methods()
    want["tokens"].add("plug-first")
    want["depth"].add("plug-skip")
    assert names == want
    summaries = {m["name"]: m["summary"] for ms in listed.values() for m in ms}
    assert summaries["plug-first"].startswith("Plug-first: keep the first K visual tokens")
    assert summaries["plug-skip"].startswith("Plug-skip: skip the block before the last one")
    base, plug = (json.loads((out / f"{n}.json").read_text()) for n in ("base", "plugin"))
    assert plug["recipe"] != base["recipe"]
    assert "plug-first" in plug["recipe"] and "plug-skip" in plug["recipe"]
    layers, plugged = base["costs"]["layer_flops"]["prefill"], plug["costs"]["layer_flops"]["prefill"]
    skipped = str(len(layers) - 2)
    assert layers[skipped] > 0 and not plugged.get(skipped)  # the block never ran
    first = min(layers, key=int)
    assert 0 < plugged[first] < layers[first]  # tokens dropped before layer 0


@pytest.fixture
def fresh_load(monkeypatch):
    """load_methods as in a new process (nothing loaded), the registries restored afterwards."""
    load_methods()
    for axis, reg in REGISTRIES.items():
        monkeypatch.setitem(REGISTRIES, axis, dict(reg))
    monkeypatch.setattr(protocol, "_loaded", False)
    monkeypatch.setattr(protocol, "_plugins", set())

    def with_entry_points(*eps: EntryPoint) -> None:
        monkeypatch.setattr(protocol, "entry_points", lambda group: [e for e in eps if e.group == group])

    return with_entry_points


def test_a_plugin_that_fails_to_load_gets_one_line_naming_it(fresh_load):
    from typer.testing import CliRunner

    from trimvlm.cli import app

    fresh_load(EntryPoint("broken", "no_such_module_xyz.methods", "trimvlm.methods"))
    with pytest.raises(PluginError) as e:
        load_methods()
    msg = str(e.value)
    assert "\n" not in msg and "'broken'" in msg and "no_such_module_xyz" in msg and "trimvlm.methods" in msg
    res = CliRunner().invoke(app, ["methods"])
    assert res.exit_code == 2
    assert res.output.strip().startswith("error:") and "'broken'" in res.output
    assert "Traceback" not in res.output
    with pytest.raises(PluginError):  # not cached as loaded: the next look-up says it again
        protocol.build("tokens", "random", {"keep": 0.5})


def test_a_callable_entry_point_is_called_once(fresh_load, tmp_path, monkeypatch):
    mod = tmp_path / "trimvlm_plug_calls.py"
    mod.write_text("CALLS = []\ndef install():\n    CALLS.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh_load(EntryPoint("calls", "trimvlm_plug_calls:install", "trimvlm.methods"),
               EntryPoint("other", "trimvlm_plug_calls:install", "another.group"))  # fmt: skip
    load_methods()
    load_methods()
    calls = sys.modules["trimvlm_plug_calls"].CALLS
    assert calls == [1]
    monkeypatch.delitem(sys.modules, "trimvlm_plug_calls")


def test_a_method_name_registered_twice_is_refused(fresh_load):
    load_methods()

    class Impostor:
        pass

    with pytest.raises(RecipeError) as e:
        register("tokens", "fastv")(Impostor)
    msg = str(e.value)
    assert "\n" not in msg and "'fastv'" in msg and "trimvlm.tokens.fastv.FastV" in msg and "Impostor" in msg
    assert REGISTRIES["tokens"]["fastv"].__name__ == "FastV"
    register("tokens", "fastv")(REGISTRIES["tokens"]["fastv"])  # the same class again (a re-import) is fine
