"""A Recipe says what to apply: `tokens` (prefill visual-token reduction), `kv` (decode KV eviction),
`depth` (skipped layers). It is data: parsed from a short string or YAML/JSON, saved with results, replayed.

String form: `tokens=density:keep=0.25:layer=3,kv=density:keep=0.25` (axis=method:option=value:...).
YAML form: a mapping `{name: ..., tokens: {method: density, keep: 0.25, layer: 3}, kv: "density:keep=0.25"}`,
or a list of those / of strings. An empty recipe (or "baseline") applies nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from trimvlm.errors import RecipeError

AXES = ("tokens", "kv", "depth")


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

    @property
    def is_baseline(self) -> bool:
        return all(getattr(self, a) is None for a in AXES)

    def label(self) -> str:
        if self.name:
            return self.name
        if self.is_baseline:
            return "baseline"
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) is not None)

    def build(self) -> dict:
        """Instantiate the methods (validating every option); axis -> method object."""
        from trimvlm.registry import build_method

        return {a: build_method(a, spec.method, spec.options) for a in AXES if (spec := getattr(self, a))}


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_method(text: str) -> MethodSpec:
    parts = [p for p in str(text).split(":") if p != ""]
    if not parts:
        raise RecipeError("empty method spec; expected method:option=value:...")
    opts = {}
    for p in parts[1:]:
        if "=" not in p:
            raise RecipeError(f"option {p!r} in {text!r} is not of the form option=value")
        k, v = p.split("=", 1)
        opts[k.strip()] = _value(v.strip())
    return MethodSpec(method=parts[0].strip(), options=opts)


def parse_recipe(spec: str | dict | Recipe | None) -> Recipe:
    if spec is None or isinstance(spec, Recipe):
        return spec or Recipe()
    if isinstance(spec, dict):
        return _from_mapping(spec)
    text = str(spec).strip()
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
        fields[axis] = parse_method(rest)
    return Recipe(**fields)


def _from_mapping(data: dict) -> Recipe:
    unknown = set(data) - set(AXES) - {"name"}
    if unknown:
        raise RecipeError(f"unknown recipe key(s) {sorted(unknown)}; allowed: name, {', '.join(AXES)}")
    fields: dict = {"name": str(data.get("name", ""))}
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
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe file {path} does not parse as YAML/JSON: {e}") from e
    if isinstance(data, dict) and "recipes" in data:
        data = data["recipes"]
    if data is None:
        data = []
    if not isinstance(data, list):
        data = [data]
    recipes = [parse_recipe(x) for x in data]
    for r in recipes:
        r.build()  # validate every method and option now, before any model runs
    if not any(r.is_baseline for r in recipes):
        recipes.insert(0, Recipe(name="baseline"))
    return recipes
