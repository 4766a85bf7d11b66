"""The lmms-eval bridge: any lmms-eval task through trimvlm (optional extra `trimvlm[lmms]`; `make lmms` on
the CPU torch). docs/scale-out.md lists the model args and what each request type does.

    python -m lmms_eval --model trimvlm \\
        --model_args pretrained=demo,tokens=density:keep=0.5:layer=3,kv=density:keep=0.25,executor=auto \\
        --tasks pope --batch_size 8

lmms-eval resolves `--model` through its v2 registry, which reads the `lmms_eval.models` entry point:
trimvlm's pyproject registers `manifest` below. `TrimVLM.costs` holds the running sums of every call's costs
per request type, logged when its requests finish.
"""

from __future__ import annotations

import json
from collections import defaultdict

from trimvlm.errors import InputError, RecipeError, TrimVLMError
from trimvlm.evals.run import grouped
from trimvlm.plan import build_methods
from trimvlm.progress import steps
from trimvlm.recipe import AXES, Recipe, parse_recipe

try:
    from lmms_eval.api.model import lmms as _LmmsBase
except ImportError as e:  # the manifest below is importable without lmms-eval; the class needs it
    _LMMS_ERROR = e

    class _LmmsBase:  # type: ignore[no-redef]
        def __init__(self, *a, **k):
            raise TrimVLMError(
                f"the lmms-eval bridge needs lmms-eval ({_LMMS_ERROR}): `make lmms` on the CPU torch, "
                'or `pip install "trimvlm[lmms]"`'
            )


MODEL_ID = "trimvlm"
IMAGE_PLACEHOLDER = "<image>"  # lmms-eval's placeholder in some contexts: trimvlm places the images itself
COST_FIELDS = (
    "model_flops",  # every phase: prefill (vision included), decode, candidate branches
    "prefill_flops",
    "decode_flops",
    "method_total_flops",
    "total_flops",
    "kv_bytes",
)


def manifest():
    """The `lmms_eval.models` entry point's payload: lmms-eval's v2 registry calls it at import."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=f"{__name__}.TrimVLM")


def _unquote(v):
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
        return v[1:-1]
    return v


def _positive_int(name: str, v) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = None
    if n is None or n <= 0 or (isinstance(v, float) and v != n):
        raise InputError(f"{name} must be a positive integer, got {v!r}")
    return n


def build_recipe(recipe=None, **axes) -> Recipe:
    """The one recipe of a bridge run: `recipe` (a string, a dict, a Recipe, or a YAML/JSON file with one
    recipe) and/or one spec per axis (`tokens="density:keep=0.5:layer=3"`); an axis given twice is refused."""
    base = parse_recipe(_unquote(recipe))  # a file: the one recipe it holds
    given = {a: _unquote(v) for a, v in axes.items() if v is not None}
    for a in given:
        if getattr(base, a) is not None:
            raise RecipeError(f"recipe axis {a!r} is given twice (in recipe= and as {a}=); give it once")
    if given:
        extra = parse_recipe(",".join(f"{a}={v}" for a, v in given.items()))
        base = base.model_copy(update={a: getattr(extra, a) for a in given})
    build_methods(base)  # unknown methods / options fail now, before any request runs
    return base


class TrimVLM(_LmmsBase):
    """An lmms-eval simple model backed by a trimvlm `VLM` and one recipe (docs/scale-out.md)."""

    is_simple = True

    def __init__(
        self,
        pretrained: str = "demo",
        recipe=None,
        tokens=None,
        kv=None,
        depth=None,
        router=None,
        executor: str = "auto",
        device: str | None = None,
        dtype: str = "float32",
        batch_size=8,
        max_new_tokens=128,
        seed=0,
        max_batch_size=None,  # passed by lmms-eval's simple_evaluate; trimvlm's batches are `batch_size`
        vlm=None,
        **kwargs,
    ) -> None:
        super().__init__()
        import trimvlm
        from trimvlm.scoring.engine import check_executor

        if kwargs:
            raise InputError(
                f"unknown trimvlm model arg(s) {sorted(kwargs)}; allowed: pretrained, recipe, "
                f"{', '.join(AXES)}, executor, device, dtype, batch_size, max_new_tokens, seed"
            )
        executor = str(_unquote(executor))
        check_executor(executor)
        self.executor = executor
        self.recipe = build_recipe(recipe, tokens=tokens, kv=kv, depth=depth, router=router)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.seed = int(seed)
        if vlm is None:  # a VLM object may be given directly (tests, notebooks)
            if device is None:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            vlm = trimvlm.load(str(_unquote(pretrained)), dtype=dtype, device=str(device))
        self.vlm = vlm
        self.costs: dict[str, dict] = defaultdict(lambda: {k: 0 for k in COST_FIELDS} | {"seconds": 0.0})

    # --- lmms-eval's interface -------------------------------------------------------------------------
    def generate_until(self, requests) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups = grouped(requests, lambda req: self._generation_settings(req.args[1]))
        with steps("trimvlm generate", len(requests), enabled=self.rank == 0, unit="request") as bar:
            for (max_new, temperature, top_p, until), idx in groups.items():
                for b in range(0, len(idx), self.batch_size):
                    chunk = idx[b : b + self.batch_size]
                    images = [self._visuals(requests[i]) for i in chunk]
                    prompts = [self._context(requests[i]) for i in chunk]
                    res = self.vlm.generate(
                        images, prompts, recipe=self.recipe, max_new_tokens=max_new, temperature=temperature,
                        top_p=top_p, seed=self.seed,
                    )  # fmt: skip
                    self._add_costs("generate_until", res.costs)
                    for i, text in zip(chunk, res.texts, strict=True):
                        out[i] = cut_at_stop(text, until)
                    bar.advance(len(chunk))
        self._log("generate_until", len(requests))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        from trimvlm.scoring.request import ScoreRequest

        # one ScoreRequest per (doc, context): the options of a multiple-choice question share their prefix
        groups = list(grouped(requests, self._loglik_key).values())
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        with steps("trimvlm loglikelihood", len(requests), enabled=self.rank == 0, unit="request") as bar:
            for b in range(0, len(groups), self.batch_size):
                chunk = groups[b : b + self.batch_size]
                score_reqs = [ScoreRequest(images=self._visuals(requests[g[0]]), question=self._context(requests[g[0]]),
                                           candidates=[self._continuation(requests[i]) for i in g]) for g in chunk]  # fmt: skip
                for g, scores in zip(chunk, self.continuation_logliks(score_reqs), strict=True):
                    for i, (loglik, greedy) in zip(g, scores, strict=True):
                        out[i] = (-loglik, greedy)  # lmms-eval's tasks take the argmin: a loss
                bar.advance(sum(len(g) for g in chunk))
        self._log("loglikelihood", len(requests))
        return [_pair(x) for x in out]

    def generate_until_multi_round(self, requests):
        raise NotImplementedError(
            "trimvlm's lmms-eval bridge does not run generate_until_multi_round: a multi-round conversation "
            "(each round's prompt built from the previous answers) is not one trimvlm prompt; "
            "VLM.generate takes one user prompt per image set"
        )

    # --- the scoring engine -----------------------------------------------------------------------------
    def continuation_logliks(self, score_reqs) -> list[list[tuple[float, bool]]]:
        """Per request, per candidate: (log P(candidate tokens | prefix), every token greedy), from one
        `vlm.score` call (loglik readout: prefix once, candidates as branches off it; the close marker left out
        of the same per-token log-probs)."""
        res = self.vlm.score(score_reqs, readout="loglik", executor=self.executor, recipe=self.recipe)
        self._add_costs("loglikelihood", res.costs)
        return [[(c.answer_loglik, c.answer_greedy) for c in r.candidates] for r in res.results]

    # --- helpers -----------------------------------------------------------------------------------------
    def _generation_settings(self, gen_kwargs) -> tuple:
        g = dict(gen_kwargs or {})
        until = g.pop("until", None)
        until = [] if until is None else [until] if isinstance(until, str) else until
        if not isinstance(until, list | tuple) or not all(isinstance(u, str) for u in until):
            raise InputError(f"generation_kwargs['until'] must be a string or a list of strings, got {until!r}")
        beams = g.pop("num_beams", 1) or 1
        if int(beams) != 1:
            raise InputError(f"num_beams={beams}: trimvlm generates greedily or by sampling, not by beam search")
        max_new = _positive_int("max_new_tokens", g.pop("max_new_tokens", None) or self.max_new_tokens)
        temperature = float(g.pop("temperature", 0.0) or 0.0)
        if g.pop("do_sample", None) is False:
            temperature = 0.0
        top_p = g.pop("top_p", None)
        top_p = 1.0 if top_p is None else float(top_p)
        return max_new, temperature, top_p, tuple(u for u in until if u)

    def _doc(self, req):
        task, split, doc_id = req.args[-2], req.args[-1], req.args[-3]
        try:
            return self.task_dict[task][split][doc_id]
        except (KeyError, IndexError, TypeError) as e:
            raise InputError(
                f"request for doc {doc_id!r} of task {task!r} split {split!r}: lmms-eval did not hand the "
                f"bridge that doc ({e!r}); run the model through lmms-eval's evaluator"
            ) from None

    def _visuals(self, req):
        """The request's images (None for a text-only request), from its doc through doc_to_visual."""
        from PIL import Image

        if len(req.args) < 6:  # ("", continuation): the unconditional requests of acc_mutual_info
            return None
        doc_to_visual = req.args[2]
        if doc_to_visual is None:
            return None
        visuals = doc_to_visual(self._doc(req))
        visuals = [] if visuals is None else list(visuals)
        out = []
        for v in visuals:
            if not isinstance(v, Image.Image):
                raise InputError(
                    f"task {req.args[-2]!r} doc {req.args[-3]!r}: a visual of type {type(v).__name__} "
                    f"({v!r:.80}); trimvlm takes images (PIL), not video or audio"
                )
            out.append(v if v.mode == "RGB" else v.convert("RGB"))
        return out or None

    @staticmethod
    def _context(req) -> str:
        ctx = req.args[0]
        if not isinstance(ctx, str):
            raise InputError(
                f"task {req.task_name!r}: the request's context is {type(ctx).__name__}, not text"
            )
        return ctx.replace(IMAGE_PLACEHOLDER, "").strip()

    def _loglik_key(self, req) -> tuple:
        if len(req.args) < 6 or not str(req.args[0]).strip():
            raise InputError(
                f"task {req.task_name!r}: a loglikelihood request with an empty context (the unconditional "
                "requests of acc_mutual_info) cannot be expressed: trimvlm scores a continuation after a "
                "question through the model's prompt template; leave acc_mutual_info out of the metric_list"
            )
        ctx, _, _, doc_id, task, split = req.args
        return (task, split, doc_id, ctx)

    def _continuation(self, req) -> str:
        target = req.args[1]
        cont = target if isinstance(target, str) else target(self._doc(req))
        if isinstance(cont, list):
            raise InputError(
                f"task {req.task_name!r}: doc_to_target gave a list {cont!r:.80} for a loglikelihood request; "
                "give one continuation per request"
            )
        return str(cont).strip()

    def _add_costs(self, kind: str, costs) -> None:
        acc = self.costs[kind]
        for k in COST_FIELDS:
            acc[k] += int(getattr(costs, k))
        acc["seconds"] += float(sum(costs.seconds.values()))

    def _log(self, kind: str, n: int) -> None:
        from loguru import logger  # lmms-eval depends on it

        logger.info(
            f"trimvlm {kind}: {n} requests, recipe {self.recipe.label()}: {json.dumps(self.costs[kind])}"
        )


def _pair(pair: tuple[float, bool]):
    """(NLL, is_greedy) as lmms-eval's evaluator will keep it. lmms-eval 0.7.3's evaluator passes every
    response through `unwrap_generation_output`, which turns anything but text (or its GenerationResult
    wrapper) into text, so a bare tuple would reach the task as the string "(-1.2, True)"; where it does, the
    pair travels inside the GenerationResult wrapper, which it unwraps as is."""
    try:
        from lmms_eval.api.instance import GenerationResult, unwrap_generation_output
    except ImportError:  # an lmms-eval without the wrapper keeps tuples
        return pair
    if unwrap_generation_output((0.0, True))[0] == (0.0, True):
        return pair
    return GenerationResult(text=pair)  # type: ignore[arg-type]


def cut_at_stop(text: str, until) -> str:
    """The text up to the first occurrence of any stop string (lmms-eval's `until`)."""
    return text[: min((k for k in map(text.find, until) if k != -1), default=len(text))]
