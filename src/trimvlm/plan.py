"""Turn a Recipe (data) into what the runner executes: each axis' registered method fills its part of a
`runtime.plan.Plan` through the one method protocol (`check` the model, `apply` to the plan)."""

from __future__ import annotations

from trimvlm.errors import RecipeError
from trimvlm.recipe import AXES, parse_recipe
from trimvlm.registry import build_method
from trimvlm.runtime.plan import Handoff, LayerPlan, Plan

__all__ = ["Handoff", "LayerPlan", "Plan", "build_methods", "decision_plan", "make_plan"]


def build_methods(recipe) -> dict:
    """axis -> the method object its spec names (every option validated); no model needed."""
    recipe = parse_recipe(recipe)
    methods = {a: build_method(a, spec.method, spec.options) for a in AXES if (spec := getattr(recipe, a))}
    for axis, method in methods.items():
        for other in method.excludes:
            if other in methods:
                raise RecipeError(
                    f"{axis}= picks what {other}= would choose itself; do not combine {axis}= with {other}="
                )
    return methods


def decision_plan(recipe, runner) -> Plan:
    """The plan for a decision forward: token reduction and the prefill layer plan apply; a KV policy is
    refused (a decision decodes nothing, so it would change nothing and its cost line would be a lie)."""
    recipe = parse_recipe(recipe)
    if recipe.kv is not None:
        raise RecipeError(
            f"kv={recipe.kv} evicts the decode cache, and a decision decodes nothing: drop kv= from the recipe "
            "(tokens=, depth= and router= apply)"
        )
    plan = make_plan(recipe, runner)
    plan.refuse_routes("a decision")
    return plan


def make_plan(recipe, runner) -> Plan:
    """The plan of `recipe` on this model: every method checked against it, then applied in axis order."""
    recipe = parse_recipe(recipe)
    if recipe.tuned_for is not None:
        from trimvlm.depth.base import model_fingerprint

        if recipe.tuned_for != model_fingerprint(runner.adapter):
            raise RecipeError(
                f"recipe {recipe.label()!r} was tuned for another model (fingerprint {recipe.tuned_for}, this "
                f"model's is {model_fingerprint(runner.adapter)}): run trimvlm tune for this model"
            )
    plan = Plan(recipe=recipe)
    for method in build_methods(recipe).values():
        method.apply(plan, runner)
    return plan
