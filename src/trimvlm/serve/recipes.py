"""The recipes a server runs: its own (`--recipe`, the load-following ladder of `--tuned`), and a request's
`recipe` field, checked once per distinct text (a bad one: 400, before the request is tokenized). A client's
recipe may not name files on the server unless it is the server's own; `tuned=NAME` names a folder inside
`--recipe-dir`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from trimvlm.errors import InputError, RecipeError, TrimVLMError
from trimvlm.plan import decision_plan, make_plan
from trimvlm.recipe import AXES, parse_recipe
from trimvlm.serve.budgets import LoadBudget, ladder
from trimvlm.serve.errors import ApiError, as_api_error, check, schema_error

MEMO = 256  # distinct recipe texts remembered checked (the least recently asked forgotten first)


@dataclass(frozen=True)
class RecipeOptions:
    """`recipe`: the server's default (`--recipe`; "": none); `recipe_dir`: the tuned folders clients may name;
    `tuned` and `slo_ttft_ms`: budgets that follow the load (serve/budgets.py), together or not at all."""

    recipe: str = ""
    recipe_dir: str | Path | None = None
    tuned: str | Path | None = None
    slo_ttft_ms: float | None = None

    def __post_init__(self):
        if self.recipe_dir is not None and not Path(self.recipe_dir).is_dir():
            raise InputError(f"--recipe-dir {self.recipe_dir}: not a folder")
        if (self.tuned is None) != (self.slo_ttft_ms is None):
            raise InputError("--tuned DIR and --slo-ttft-ms T go together (budgets that follow the load)")


@dataclass
class Recipe:
    """A recipe a request may run with: `label` (the batching key), the parsed recipe, and the plan built when it
    was checked (its `resolution` is what the request is prepared at: tokens=downsample)."""

    label: str
    recipe: object
    plan: object = None


def reads_files(recipe) -> bool:
    """Whether a recipe names server-side files (a router checkpoint, a layer ranking): a remote request's may
    not (the server would read any path it is sent)."""
    specs = [getattr(recipe, a) for a in AXES if getattr(recipe, a) is not None]
    return recipe.router is not None or any("file" in spec.options for spec in specs)


def client_recipe(text: str, recipe_dir: Path | None):
    """A client's recipe text as `parse_recipe` may read it, or a 400 before anything is read: a recipe file
    (.yaml / .json) is refused, and `tuned=NAME` only names a tuned folder inside the server's `--recipe-dir`
    (a relative name; a path leaving the folder is refused). (The text to parse, whether it names the
    operator's folder.)"""
    stripped = text.strip()
    if stripped.startswith("tuned="):
        name, sep, options = stripped.removeprefix("tuned=").partition(":")
        check(recipe_dir is not None, "recipe: tuned= names a folder on the server; this server takes no "
              "client tuned recipes (its operator may allow some with --recipe-dir)")
        parts = Path(name).parts
        check(name and not Path(name).is_absolute() and ".." not in parts and "\\" not in name,
              f"recipe: tuned={name!r} is not a folder name inside the server's recipe folder "
              "(a relative name, no '..')")
        root = recipe_dir.resolve()
        folder = (root / name).resolve()
        check(folder.is_relative_to(root) and folder != root,
              f"recipe: tuned={name!r} is not a folder inside the server's recipe folder")
        return f"tuned={folder}{sep}{options}", True
    if stripped.endswith((".yaml", ".yml", ".json")) and not any(stripped.startswith(f"{a}=") for a in AXES):
        raise ApiError(400, "recipe: a recipe file names a path on the server; send the recipe itself "
                            "(axis=method:option=value,...)")  # fmt: skip
    return text, False


class Recipes:
    """The server's recipes over `runner`: `get(kind, text)` a request's, checked once per distinct text; `load`:
    the load-following ladder (serve/budgets.py), or None."""

    def __init__(self, runner, options: RecipeOptions):
        self.runner, self.default = runner, options.recipe or ""
        self.folder = None if options.recipe_dir is None else Path(options.recipe_dir)
        self.load = None if options.tuned is None else LoadBudget(ladder(options.tuned), options.slo_ttft_ms / 1000)
        self._checked = functools.lru_cache(MEMO)(self._check)  # (a bad recipe raises: never remembered)
        for rung in [] if self.load is None else self.load.rungs:  # each checked before the server listens
            try:
                self.get("chat", rung.text, own=True)
            except ApiError as e:
                raise InputError(f"--tuned: {e}") from e

    def get(self, kind: str, value, *, own: bool = False) -> Recipe:
        """The recipe of a request (`kind`: "decide", "chat" or "score"): its `recipe` field, else the server's.
        `own`: a recipe of the operator's (the load-following ladder), which may read the server's files."""
        if value is None:
            value = self.default
        if not isinstance(value, str):
            raise schema_error(
                f"`recipe` is a recipe string, got {type(value).__name__}", "recipe", kind="string_type"
            )
        return self._checked(kind, value, own or value == self.default)

    def _check(self, kind: str, value: str, own: bool) -> Recipe:
        text, operators = (value, True) if own else client_recipe(value, self.folder)
        try:
            parsed = parse_recipe(text)
            check(operators or not reads_files(parsed), f"recipe {value!r} reads files on the server "
                  "(router=, file=): only the server's own --recipe may; start the server with it")
            plan = (decision_plan if kind == "decide" else make_plan)(parsed, self.runner)
        except RecipeError as e:
            msg = str(e)
            if not own and self.folder is not None:  # never the server's paths in a client's answer
                msg = msg.replace(str(self.folder.resolve()), "<--recipe-dir>")
            raise ApiError(400, f"recipe {value!r}: {' '.join(msg.split())}") from e
        except TrimVLMError as e:
            raise as_api_error(e) from e
        return Recipe(label=parsed.label(), recipe=parsed, plan=plan)
