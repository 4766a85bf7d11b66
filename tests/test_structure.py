"""The structure the code keeps (issue 21): imports run one way, cli / serve / integrations -> vlm -> plan,
evals, tune, training -> methods -> runtime (adapters beside runtime), and nothing imports back up; every import
counts, the ones inside functions too."""

import ast
from pathlib import Path

import pytest

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


def test_no_function_is_over_80_lines():
    long = []
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long
