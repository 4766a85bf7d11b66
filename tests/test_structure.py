"""The structure the code keeps: imports run one way, cli / serve / integrations -> vlm -> plan,
evals, tune, training -> methods -> runtime (adapters beside runtime), and nothing imports back up; every import
counts, the ones inside functions too; and no import cycle between files."""

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

import trimvlm

ROOT = Path(trimvlm.__file__).parent
TOP = {"cli", "serve", "integrations", "testing", "__init__"} | {p.stem for p in ROOT.glob("cli_*.py")}
ABOVE_METHODS = TOP | {"vlm", "plan", "registry", "evals", "tune", "training", "demo"}
# package -> the packages it must never import
FORBIDDEN = {
    "runtime": ABOVE_METHODS | {"adapters", "tokens", "kv", "depth", "router", "decision", "scoring", "loading"},
    "adapters": ABOVE_METHODS | {"tokens", "kv", "depth", "router", "decision", "scoring"},
    "kernels": ABOVE_METHODS | {"runtime", "adapters", "tokens", "kv", "depth", "router", "decision", "scoring"},
    **{m: ABOVE_METHODS for m in ("tokens", "kv", "depth", "router", "decision", "scoring")},
    **{g: ABOVE_METHODS | {"runtime", "adapters"} for g in ("errors", "options", "protocol", "cluster", "data")},
    **{m: TOP | {"vlm"} for m in ("plan", "evals", "tune", "training")},
}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trimvlm":
            parts = node.module.split(".")
            out |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] if "." in a.name else "__init__" for a in node.names
                    if a.name.split(".")[0] == "trimvlm"}  # fmt: skip
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package):
    files = [p for p in ROOT.rglob("*.py") if _package(p) == package]
    assert files, package
    bad = {f"{p.relative_to(ROOT)} imports trimvlm.{m}" for p in files for m in _imports(p) & FORBIDDEN[package]}
    assert not bad, sorted(bad)


def test_no_function_is_over_60_lines():
    """In the library, its benchmarks and its tests."""
    repo, long = Path(__file__).resolve().parent.parent, []
    for p in [*ROOT.rglob("*.py"), *(repo / "benchmarks").glob("*.py"), *(repo / "tests").glob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long.append(f"{p}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute module an `from ... import` names (a relative one resolved against `module`)."""
    if not node.level:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _module_imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """The trimvlm modules `module` imports, wherever the import statement stands (module level, inside a
    function, under `if TYPE_CHECKING`): `import a.b` and `from a.b import name` name `a.b`; `from a import b`
    names `a.b` when that is a module (a submodule taken by name), else `a`, whose names are read."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, path.name == "__init__.py", node)
            if target and target.split(".")[0] == "trimvlm":
                out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "trimvlm"}
    return (out & modules) - {module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules it imports, over every .py file under `root`."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    return {m: _module_imports(m, p, set(files)) for m, p in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None and child not in index:
                index[child] = low[child] = len(index)
                stack.append(child), on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child is not None:
                low[node] = min(low[node], index[child]) if child in on_stack else low[node]
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.add(tuple(sorted(component)))
    return found


def test_no_import_cycles_between_files():
    """No two files of src/ import each other, directly or through others. Every import counts, the ones inside
    functions too (a function-local import hides a cycle from Python, not from the design). The rule for
    packages: importing `trimvlm.a.b` (or a name from it) is an edge to the file `a/b.py`, not to the
    `a/__init__.py` that Python also runs on the way; `from trimvlm.a import b` is an edge to `a/b.py` when `b`
    is a submodule, else to `a/__init__.py`. So a package's __init__ re-exporting its children is no cycle; it
    is one when a child (or a module it imports) takes a name from the package's __init__ back. Imports by a
    computed name (`importlib.import_module(f"...")`) are not seen."""
    found = import_cycles(import_graph())
    assert not found, "import cycles between files: " + "; ".join(" <-> ".join(c) for c in sorted(found))


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "trimvlm"


def test_the_cycle_check_sees_local_relative_and_submodule_imports(tmp_path):
    """The check itself: a cycle through a function-local import, a relative import and `from pkg import
    submodule` is found; a package's __init__ re-exporting its children is not one."""
    root = _write(tmp_path, {
        "trimvlm/__init__.py": "",
        "trimvlm/a/__init__.py": "from trimvlm.a.one import f\nfrom .two import g\n",
        "trimvlm/a/one.py": "def f():\n    from trimvlm.a import two\n",
        "trimvlm/a/two.py": "from . import one\ndef g(): pass\n",
        "trimvlm/b/__init__.py": "from trimvlm.b.leaf import h\n",
        "trimvlm/b/leaf.py": "import trimvlm.a.one\ndef h(): pass\n",
        "trimvlm/c/__init__.py": "from trimvlm.c.back import k\nNAME = 1\n",
        "trimvlm/c/back.py": "def k():\n    from trimvlm.c import NAME\n",
    })  # fmt: skip
    assert import_cycles(import_graph(root)) == {
        ("trimvlm.a.one", "trimvlm.a.two"),
        ("trimvlm.c", "trimvlm.c.back"),
    }


# a reference to the project's own tracker (an issue's number, with or without the word): history, which
# belongs in CHANGELOG.md
TRACKER = re.compile(r"\bissues? \d+|(?<![\w/&\"'])#\d{1,5}\b", re.I)


def test_code_names_no_issue_numbers():
    """Docstrings and comments of src/ and tests/ say what the code does, not which issue brought it (another
    project's issue, `owner/repo#N`, is a reference and stays). tests/test_docs.py is left out: its examples of
    history are the data of the docs' history check."""
    files = [*ROOT.rglob("*.py"), *(p for p in (REPO / "tests").rglob("*.py") if p.name != "test_docs.py")]
    found = [f"{p.relative_to(p.parents[1])}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if TRACKER.search(line)]  # fmt: skip
    assert found == []
    assert TRACKER.search("the path before issue " + "20") and TRACKER.search("see #" + "33")
    assert not TRACKER.search("ray-project/ray#31145") and not TRACKER.search("colour '#1f77b4'")
    assert not TRACKER.search('BLACK = "#000000"')
