import ast
import importlib
import importlib.util
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from trimvlm.protocol import REGISTRIES
from trimvlm.testing import FAMILIES, random_image, tiny_checkpoint

pytest_plugins = ("own_process",)  # tests marked own_process run in a child pytest (tests/own_process.py)

REPO = Path(__file__).resolve().parent.parent  # the repository root: tests never read files through the cwd

AVAILABLE = [f for f in FAMILIES if importlib.util.find_spec(f"trimvlm.testing.tiny_{f}") is not None]
# .ci/run installs every optional extra and sets this: there a missing extra fails its tests instead of
# skipping them (a broken install must not pass as "skipped").
REQUIRE_EXTRAS = os.environ.get("TRIMVLM_REQUIRE_EXTRAS", "") not in ("", "0")


def fail_if_required(error: str | None) -> None:
    """An extra's tests could not import it (`error`): under TRIMVLM_REQUIRE_EXTRAS that fails them (at
    collection, so the whole module fails); otherwise the caller skips them."""
    if error is not None and REQUIRE_EXTRAS:
        pytest.fail(f"{error} (TRIMVLM_REQUIRE_EXTRAS is set: .ci/run installs every extra)", pytrace=False)


def optional(module: str, hint: str):
    """(the optional `module`, or None; a skip marker for the tests that need it). Under TRIMVLM_REQUIRE_EXTRAS
    a failed import fails the module instead."""
    try:
        mod, error = importlib.import_module(module), None
    except Exception as e:  # ImportError, or an extra failing to import beside this torch
        mod, error = None, f"{module} cannot be imported ({type(e).__name__}: {e}); {hint}"
    fail_if_required(error)
    return mod, pytest.mark.skipif(error is not None, reason=str(error))


def need_extra(*modules: str, hint: str = "the serve extra (pip install 'trimvlm[serve]')"):
    """Import the optional `modules` a test needs (the last one is returned): skip when one is missing,
    fail instead under TRIMVLM_REQUIRE_EXTRAS. Works at module level and inside a test."""
    mod = None
    for name in modules:
        mod, mark = optional(name, hint)
        if mod is None:
            pytest.skip(mark.kwargs["reason"], allow_module_level=True)
    return mod


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    made = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = tiny_checkpoint(family, tmp_path_factory.mktemp(family), **kw)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_adapter(tiny_dir):
    from trimvlm.loading import load_adapter

    made = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = load_adapter(tiny_dir(family, **kw))
        return made[key]

    return get


def hand_flops(cfg, batch: int, q: int, k: int, layers: int = 1) -> int:
    """Matmul FLOPs (2 per multiply-add) of `layers` attention decoder layers of a dense (SwiGLU) text config,
    counted by hand from its sizes: q/k/v/o projections, the gate/up/down MLP, and QK^T plus AV over k keys."""
    d, h, kv, hd, m = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.intermediate_size)  # fmt: skip
    linear = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * m
    return layers * (2 * batch * q * linear + 4 * batch * h * q * k * hd)


def ragged_batch():
    """Three samples with different image sizes and prompt lengths."""
    images = [[random_image(1, (64, 64))], [random_image(2, (96, 64))], [random_image(3, (64, 128))]]
    prompts = ["what is the colour", "how many red circle are there in the image", "describe"]
    return images, prompts


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def _scratch_session_cwd(tmp_path_factory):
    """Session and module fixtures (set up before a test's own directory) run in a scratch directory too."""
    with pytest.MonkeyPatch.context() as m:
        m.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(autouse=True)
def _scratch_cwd(tmp_path, monkeypatch):
    """Every test runs in a scratch directory of its own (its `tmp_path`): nothing a test or a command writes
    to the working directory lands in the repository, and nothing there (a stray scene.png) is read."""
    monkeypatch.chdir(tmp_path)


def pytest_addoption(parser):
    parser.addoption("--reverse-files", action="store_true", default=False,
                     help="run the test files in reverse order (each file's tests in their own order): the suite "
                          "must not depend on which file ran first")  # fmt: skip


def pytest_report_header(config):
    return "test files in reverse order (--reverse-files)" if config.getoption("--reverse-files") else None


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--reverse-files"):
        return
    files = list(dict.fromkeys(item.path for item in items))
    rank = {path: n for n, path in enumerate(reversed(files))}
    items.sort(key=lambda item: rank[item.path])  # stable: a file's own order is kept


def plan_prefill(runner, prep, recipe, **kw):
    """`Runner.prefill` with a recipe's plan; (output, meter, plan)."""
    from trimvlm.plan import make_plan
    from trimvlm.runtime.meter import Meter

    plan = make_plan(recipe, runner)
    meter = Meter()
    out = runner.prefill(prep, plan, meter=meter, **kw)
    return out, meter, plan


@pytest.fixture(scope="module")
def vlms(tiny_adapter):
    """family -> a VLM over the tiny model of that family (built once per module)."""
    from trimvlm.vlm import VLM

    made = {}

    def get(family):
        if family not in made:
            made[family] = VLM(tiny_adapter(family))
        return made[family]

    return get


@pytest.fixture(scope="module")
def demo():
    """The shipped demo model, loaded once per module (a module may define its own)."""
    import trimvlm

    return trimvlm.load("demo")


@pytest.fixture
def one_thread():
    """One thread: on the shared 2-core machine, 2 threads run the Qwen3.5 reference kernels ~5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def merged_tree(monkeypatch):
    """`tree-merged` = the tree executor with its cost rule off: always the merged trie layout (ancestors,
    pieces, recurrent levels), so small cases exercise that machinery too."""
    from trimvlm.scoring.executors import EXECUTORS as RUN
    from trimvlm.scoring.executors import NAMES, tree, tree_layout

    def merged(work):
        with monkeypatch.context() as m:
            m.setattr(tree, "plan_pieces", lambda f, mix=None: tree_layout.merged_layout(f))
            return tree.run(work)

    monkeypatch.setitem(RUN, "tree-merged", merged)
    monkeypatch.setattr("trimvlm.scoring.executors.NAMES", (*NAMES, "tree-merged"))
    monkeypatch.setattr("trimvlm.scoring.engine.NAMES", (*NAMES, "tree-merged"))
    monkeypatch.setattr("trimvlm.scoring.engine.MERGED", {"segments", "tree", "tree-merged"})


class RunnerCalls:
    """Counts `Runner.prefill` calls and the vision tower's forwards (its first attention module's)."""

    def __init__(self, runner, monkeypatch):
        self.prefills, self.vision = 0, 0
        real = runner.prefill

        def prefill(*a, **kw):
            self.prefills += 1
            return real(*a, **kw)

        monkeypatch.setattr(runner, "prefill", prefill)
        modules = runner.adapter.vision_attention_modules()
        self._hook = modules[0].register_forward_hook(lambda *_: self._seen())

    def _seen(self):
        self.vision += 1

    def close(self):
        self._hook.remove()


@contextmanager
def reserved_port():
    """A port of 127.0.0.1 that nothing else is given while the block runs: a socket bound to it with
    SO_REUSEADDR, never listening, is held until the block ends. A server started inside the block binds and
    listens on it (uvicorn and `shared_port` set SO_REUSEADDR, which such a socket admits), while the kernel
    hands the port to no other bind to port 0 and no outgoing connection."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def free_port() -> int:
    """A port free a moment ago, released at once (another process may take it first): only for a server that
    cannot share a reserved one (Ray Serve's proxy binds without SO_REUSEADDR); use `reserved_port` else."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live(state):
    """A real uvicorn server over `state` on 127.0.0.1 in a thread, on a port it binds itself (port 0); its
    base URL. It is shut down gracefully at the end (uvicorn waits for the open requests, then the app's
    scheduler stops)."""
    import uvicorn

    from trimvlm.serve.app import build_app

    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=0, log_config=None, log_level="info",
                            access_log=False, lifespan="on")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(60)


def declared_methods() -> dict[str, set[str]]:
    """axis -> the names that `register("axis", "name")` calls in trimvlm's source files declare (read from the
    files, not imported), with every file holding one checked to lie in its axis' package (which discovery
    walks)."""
    out: dict[str, set[str]] = {axis: set() for axis in REGISTRIES}
    src = Path(importlib.util.find_spec("trimvlm").origin).parent
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "register":
                axis, name = (a.value for a in node.args[:2])
                where = path.relative_to(src).parts[0]
                assert where == axis, f"{path} registers {axis}={name} outside trimvlm/{axis}/"
                out[axis].add(name)
    return out
