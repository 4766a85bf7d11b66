"""A Recipe says what to apply: `tokens` (prefill visual-token reduction), `kv` (decode KV eviction),
`depth` (skipped layers), `router` (the meta-router). It is data: parsed from a short string or YAML/JSON, saved with results, replayed.

String form: `tokens=density:keep=0.25:layer=3,kv=density:keep=0.25` (axis=method:option=value:...).
YAML form: a mapping `{name: ..., tokens: {method: density, keep: 0.25, layer: 3}, kv: "density:keep=0.25"}`,
or a list of those / of strings. An empty recipe (or "baseline") applies nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from trimvlm.errors import RecipeError

AXES = ("tokens", "kv", "depth", "router")


class MethodSpec(BaseModel):
    method: str
    options: dict[str, Any] = Field(default_factory=dict)

    def __str__(self) -> str:
        return ":".join([self.method] + [f"{k}={v}" for k, v in self.options.items()])


class Recipe(BaseModel):
    name: str = ""
    tokens: MethodSpec | None = None
    kv: MethodSpec | None = None
    depth: MethodSpec | None = None
    router: MethodSpec | None = None  # the method is the router checkpoint's folder: router=PATH:token_keep=...
    tuned_for: str | None = None  # a tuned recipe: the fingerprint of the model `trimvlm tune` found it for

    @property
    def is_baseline(self) -> bool:
        return all(getattr(self, a) is None for a in AXES)

    def label(self) -> str:
        if self.name:
            return self.name
        if self.is_baseline:
            return "baseline"
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) is not None)


_INT = r"[+-]?\d+"
_FLOAT = r"[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?"
_BOOLS = {"true": True, "false": False}


def _value(text: str):
    """An option value from its text, by explicit rules (not YAML 1.1's): an integer in base 10 ("010" is
    10), a float ("0.5", ".5", "1e-1"), true / false in any case, else the text itself ("off", "no", "0x10",
    "nan" and "" stay strings, which the method then refuses or accepts)."""
    t = text.strip()
    if re.fullmatch(_INT, t):
        return int(t, 10)
    if re.fullmatch(_FLOAT, t):
        return float(t)
    return _BOOLS.get(t.lower(), t)


class _Loader(yaml.SafeLoader):
    """YAML whose unquoted scalars follow `_value`'s rules instead of YAML 1.1's: `010` is 10, `1e-1` 0.1,
    `off` / `no` / `2024-01-01` strings. Quoted scalars are strings; `null` / `~` stay None."""


_YAML_TYPED = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float", "timestamp")}
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in rules if tag not in _YAML_TYPED]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "!trimvlm-value", re.compile(rf"(?:{_INT}|{_FLOAT}|(?i:true|false))\Z"), list("+-.0123456789tTfF")
)
_Loader.add_constructor("!trimvlm-value", lambda loader, node: _value(loader.construct_scalar(node)))


def parse_method(text: str) -> MethodSpec:
    parts = [p for p in str(text).split(":") if p != ""]
    if not parts:
        raise RecipeError("empty method spec; expected method:option=value:...")
    opts = {}
    for p in parts[1:]:
        if "=" not in p:
            raise RecipeError(f"option {p!r} in {text!r} is not of the form option=value")
        k, v = (x.strip() for x in p.split("=", 1))
        if k in opts:
            raise RecipeError(f"option {k!r} given twice in {text!r}; give each option once")
        opts[k] = _value(v)
    return MethodSpec(method=parts[0].strip(), options=opts)


def parse_recipe(spec: str | dict | Recipe | None) -> Recipe:
    if spec is None or isinstance(spec, Recipe):
        return spec or Recipe()
    if isinstance(spec, dict):
        return _from_mapping(spec)
    text = str(spec).strip()
    if text.startswith("tuned="):
        return tuned_recipe(text)
    if text.endswith((".yaml", ".yml", ".json")) and not re.match(rf"\s*({'|'.join(AXES)})\s*=", text):
        return _one_recipe(Path(text))
    if text in ("", "baseline", "none"):
        return Recipe(name="baseline" if text == "baseline" else "")
    fields: dict = {}
    for item in text.split(","):
        if "=" not in item:
            raise RecipeError(f"recipe part {item!r} is not axis=method:...; axes: {', '.join(AXES)}")
        axis, rest = item.split("=", 1)
        axis = axis.strip()
        if axis not in AXES:
            raise RecipeError(f"unknown recipe axis {axis!r}; allowed: {', '.join(AXES)}")
        if axis in fields:
            raise RecipeError(f"recipe {text!r} gives {axis}= twice; one method per axis ({', '.join(AXES)})")
        fields[axis] = parse_method(rest)
    return Recipe(**fields)


def _from_mapping(data: dict) -> Recipe:
    unknown = set(data) - set(AXES) - {"name", "tuned_for"}
    if unknown:
        raise RecipeError(f"unknown recipe key(s) {sorted(unknown)}; allowed: name, tuned_for, {', '.join(AXES)}")
    fields: dict = {"name": str(data.get("name", "")), "tuned_for": data.get("tuned_for")}
    for axis in AXES:
        v = data.get(axis)
        if v is None:
            continue
        if isinstance(v, str):
            fields[axis] = parse_method(v)
        elif isinstance(v, dict) and "method" in v:
            fields[axis] = MethodSpec(
                method=v["method"], options={k: x for k, x in v.items() if k != "method"}
            )
        else:
            raise RecipeError(
                f"recipe {axis}: expected 'method:opt=val' or a mapping with 'method', got {v!r}"
            )
    return Recipe(**fields)


def load_recipes(path: str | Path) -> list[Recipe]:
    """A YAML/JSON file holding one recipe, a list of recipes, or {recipes: [...]}. Baseline is added first."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader with explicit value rules
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe file {path} does not parse as YAML/JSON: {e}") from e
    if isinstance(data, dict) and "recipes" in data:
        data = data["recipes"]
    if data is None:
        data = []
    if not isinstance(data, list):
        data = [data]
    recipes = [parse_recipe(x) for x in data]
    if not any(r.is_baseline for r in recipes):
        recipes.insert(0, Recipe(name="baseline"))
    return recipes


def _one_recipe(path: Path) -> Recipe:
    """The one recipe a file holds (`--recipe DIR/best-total_flops-0.75.yaml`)."""
    found = [r for r in load_recipes(path) if not (r.is_baseline and r.label() == "baseline")]
    if len(found) != 1:
        raise RecipeError(f"recipe file {path} holds {len(found)} recipes; one is expected here (a file of "
                          "several is for trimvlm eval --recipes)")  # fmt: skip
    return _relocated(found[0], path.parent) if found[0].tuned_for else found[0]


def _relocated(recipe: Recipe, folder: Path) -> Recipe:
    """A tuned recipe's ranking file, found in its tune folder (`rankings/`) when the folder has moved."""
    spec = recipe.depth
    if spec is None or "file" not in spec.options or Path(str(spec.options["file"])).exists():
        return recipe
    moved = Path(folder) / "rankings" / Path(str(spec.options["file"])).name
    if not moved.exists():
        return recipe
    depth = MethodSpec(method=spec.method, options={**spec.options, "file": str(moved)})
    return recipe.model_copy(update={"depth": depth})


def tuned_recipe(text: str) -> Recipe:
    """`tuned=DIR:budget=0.75` (or `tuned=DIR:total_flops=0.75:kv_bytes=0.3`): the best recipe `trimvlm tune`
    found for that budget point, read from DIR/tune.json. `budget=X` names the point whose only, or first, axis
    is X."""
    spec = parse_method(text.removeprefix("tuned="))
    path = Path(spec.method) / "tune.json"
    if not path.exists():
        raise RecipeError(f"tuned recipe: {path} not found (a folder written by trimvlm tune --out DIR)")
    rep = json.loads(path.read_text())
    points = [b for b in rep["budgets"] if b.get("best")]
    want = dict(spec.options)
    if set(want) == {"budget"}:
        found = [b for b in points if abs(next(iter(b["budget"].values())) - float(want["budget"])) < 1e-9]
    else:
        found = [b for b in points if set(b["budget"]) == set(want)
                 and all(abs(b["budget"][a] - float(v)) < 1e-9 for a, v in want.items())]  # fmt: skip
    if len(found) != 1:
        have = ", ".join(b["label"] for b in points) or "none"
        raise RecipeError(f"tuned recipe {text!r}: {len(found)} budget points of {path} match; it has: {have}")
    entry = next(e for e in rep["entries"] if e["spec"] == found[0]["best"])
    recipe = _from_mapping({**entry["recipe"], "name": f"tuned-{found[0]['label']}", "tuned_for": rep["fingerprint"]})
    return _relocated(recipe, path.parent)
