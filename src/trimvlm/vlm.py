"""The public object: a loaded model with its adapter and runner."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import torch

from trimvlm.adapters.base import Conversation, resolution
from trimvlm.decision.config import model_config
from trimvlm.errors import InputError, UnsupportedModelError, caller_stacklevel
from trimvlm.options import is_int
from trimvlm.plan import make_plan
from trimvlm.runtime.generate import Sampling, generate
from trimvlm.runtime.limits import check_generation
from trimvlm.runtime.meter import Costs, Meter
from trimvlm.runtime.prefix_cache import PrefixCache
from trimvlm.runtime.runner import Runner
from trimvlm.runtime.vision_cache import VisionCache


class UnknownWordsWarning(UserWarning):
    """Most of a prompt's words are unknown to the model's tokenizer: the answer is a guess."""


def unknown_words(tokenizer, text: str) -> list[str]:
    """The words of `text` the tokenizer can only read as its unknown token (a word-level vocabulary, like the
    demo models'; byte-level tokenizers have no unknown token, so nothing)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    return [w for w in text.split() if set(tokenizer(w, add_special_tokens=False)["input_ids"]) == {unk}]


def warn_unknown_words(tokenizer, prompts) -> None:
    """An `UnknownWordsWarning` for each prompt (a string or a `Conversation`, or a list of them) most of whose
    words are unknown."""
    for text in [prompts] if isinstance(prompts, str | Conversation) else prompts or []:
        if isinstance(text, Conversation):  # its user turns' words
            text = " ".join(t.text for t in text.turns if t.role == "user")
        if not isinstance(text, str):
            continue
        words, unknown = text.split(), unknown_words(tokenizer, text)
        if words and 2 * len(unknown) > len(words):
            shown = " ".join(unknown[:6]) + (" ..." if len(unknown) > 6 else "")
            warnings.warn(UnknownWordsWarning(
                f"{len(unknown)} of the prompt's {len(words)} words are unknown to this model's tokenizer "
                f"({shown}); its answer will be a guess (the demo models read the questions `trimvlm demo-image` "
                "prints)"), stacklevel=caller_stacklevel())  # fmt: skip


@dataclass
class GenerationResult:
    texts: list[str]
    tokens: list[list[int]]
    recipe: str
    costs: Costs

    def as_dict(self) -> dict:
        return {**vars(self), "costs": self.costs.as_dict()}


class VLM:
    def __init__(self, adapter):
        self.adapter = adapter
        self.runner = Runner(adapter)

    @cached_property
    def decision_config(self):
        """The checkpoint's own `DecisionConfig` (decision/config.py, `model_config`), read once: what `decide`
        uses unless it is given one."""
        return model_config(self.adapter)

    @cached_property
    def decision_processor(self):
        """The model's processor for decisions, built once (transformers adds its sentinels to it)."""
        return self.adapter.decision_processor()

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def tokenizer(self):
        return self.adapter.tokenizer

    def stop_ids(self) -> list[int]:
        """The tokenizer's end-of-sequence token and the generation config's (one id or a list of them)."""
        gen_eos = getattr(self.adapter.model.generation_config, "eos_token_id", None)
        ids = {self.tokenizer.eos_token_id, *([gen_eos] if isinstance(gen_eos, int) else gen_eos or ())}
        return sorted(i for i in ids if i is not None)

    def prepare(self, images, prompts, plan=None):
        """One prompt (a string, or a `Conversation`; images: None, one image or path, or a list of them) or a
        batch (a list of prompts, a list with one such image entry per prompt), at `plan`'s `resolution`."""
        if isinstance(prompts, str | Conversation):
            prompts, images = [prompts], [images]
        elif not isinstance(prompts, list | tuple) or not all(isinstance(p, str | Conversation) for p in prompts):
            raise InputError(f"prompts must be a string or a list of strings, got {prompts!r:.80}")
        elif not isinstance(images, list | tuple):
            raise InputError(
                f"images is {images!r:.80} for a batch of {len(prompts)} prompts: give a list with one entry "
                "per prompt (an image, a path, a list of them, or None for a text-only prompt)"
            )
        if not prompts:
            raise InputError("no prompts given")
        marker = self.tokenizer.convert_ids_to_tokens(self.adapter.image_token_id)
        if any(marker in t for p in prompts for t in (p.texts() if isinstance(p, Conversation) else [p])):  # the adapter writes each image's tokens itself
            raise InputError(f"a prompt contains the image token {marker!r}: pass the images instead")
        target = None if plan is None else plan.resolution
        with resolution(target):
            prepared = self.adapter.prepare(list(images), list(prompts))
        prepared.resolution = target
        return prepared

    @torch.no_grad()
    def generate(
        self,
        images,
        prompts,
        *,
        recipe=None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        track_memory: bool = False,
        prepared=None,
    ) -> GenerationResult:
        """Generate for one prompt (images: one image/path or a list) or a batch (lists of equal length).
        `track_memory`: measure peak memory on the tensors (slower; on CUDA the allocator's peak is always
        measured). `presence_penalty`, `frequency_penalty`: OpenAI's (runtime/generate.py, `Sampling`).
        `prepared`: a prepared batch (`vlm.prepare`, `adapter.collate`; then images=None, prompts=None)."""
        self._needs_lm_head("generate")
        if not is_int(max_new_tokens) or max_new_tokens <= 0:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty)  # checks them, before any work  # fmt: skip
        plan = make_plan(recipe, self.runner)
        if prepared is None:
            warn_unknown_words(self.tokenizer, prompts)
            prepared = self.prepare(images, prompts, plan=plan)
        elif images is not None or prompts is not None:
            raise InputError("give images and prompts, or a prepared batch (then images=None, prompts=None)")
        check_generation(self.adapter, prepared, max_new_tokens)  # before any model work
        pad, stops = self.tokenizer.pad_token_id, self.stop_ids()
        out = generate(
            self.runner,
            prepared,
            plan,
            max_new_tokens=max_new_tokens,
            stop_ids=stops,
            pad_id=0 if pad is None else pad,
            sampling=sampling,
            meter=Meter(device=self.runner.device, track_tensors=track_memory),
        )
        rows = [out.tokens[b, : int(out.lengths[b])].tolist() for b in range(prepared.batch)]
        toks = [[t for t in row if t not in stops] for row in rows]
        texts = [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t in toks]
        return GenerationResult(texts=texts, tokens=toks, costs=out.costs, recipe=plan.recipe.label())

    @cached_property
    def head(self):
        """The decision head saved next to the checkpoint (None when there is none), loaded once (settable)."""
        from trimvlm.scoring.head import DecisionHead

        return DecisionHead.load(self.adapter.folder, device=self.adapter.device)

    @torch.no_grad()
    def score(
        self,
        images,
        question=None,
        candidates=None,
        *,
        readout: str = "loglik",
        executor: str = "auto",
        recipe=None,
        binary=False,
        track_memory: bool = False,
    ):
        """Score candidates against image(s) + question, prefix encoded once. One request (question a string)
        or a batch (lists of questions, image entries and candidate lists; or `ScoreRequest`s as the first
        argument). Returns a `ScoreBatch`: per request the candidate logits in the original order,
        probabilities, the choice, per-candidate log-likelihood, the abstention logit (head readout), the costs."""
        from trimvlm.scoring.engine import score_requests
        from trimvlm.scoring.request import as_requests

        self._needs_lm_head("score")

        requests = as_requests(images, question, candidates, binary)
        warn_unknown_words(self.tokenizer, question)
        plan = make_plan(recipe, self.runner)
        return score_requests(self, requests, readout=readout, executor=executor, plan=plan, track_memory=track_memory)

    @torch.no_grad()
    def decide(
        self,
        requests,
        *,
        recipe=None,
        decision_config=None,
        return_costs: bool = False,
        limits=None,
        track_memory: bool = False,
    ):
        """Answer System One decision requests: `{"state": ..., "questions": {name: {"type": "noul" | "choice" |
        "score", "instructions": ..., "criteria": ...}}, "assets": {placeholder: image}}` (a dict or its JSON;
        an image is a System One asset `{"data_base64": ...}`, base64 text, a PIL image or a file path).

        One request returns its answers, `{name: {"type": ..., "probabilities": ..., "confidence": ..., ...}}`
        exactly as transformers' `DecisionPipeline` returns them; a list of requests returns a list of those,
        all prompts of all requests run as one batch. With `return_costs=True` the result is a
        `trimvlm.decision.DecisionResult` instead: `.answers` (always a list), `.usage` (per request a
        `RequestCosts`: input tokens, FLOPs, KV bytes, latency), `.costs` (the whole batch).

        `recipe`: token reduction and layer plans apply (a KV policy is refused: nothing is decoded).
        `decision_config`: a transformers `DecisionConfig`, a dict of its fields, a folder or decision.json
        path; default: the model's (docs/decisions.md). `limits`: a `trimvlm.decision.Limits` (questions,
        assets, sizes). Bad requests raise `trimvlm.decision.DecisionError` subclasses."""
        from trimvlm.decision import decide
        from trimvlm.plan import decision_plan

        plan = decision_plan(recipe, self.runner)  # a bad recipe fails before any request is tokenized
        result, single = decide(
            self, requests, plan, decision_config=decision_config, limits=limits, track_memory=track_memory
        )
        if return_costs:
            return result
        return result.answers[0] if single else result.answers

    def _needs_lm_head(self, what: str) -> None:
        if self.adapter.decision_head is not None:
            raise UnsupportedModelError(
                f"{what}: this checkpoint is a decision model ({type(self.adapter.decision_head).__name__} head, "
                "no LM head); ask it System One requests with vlm.decide / `trimvlm decide`"
            )

    def use_caches(self, *, vision_bytes: int | None = None, prefix_bytes: int | None = None) -> dict:
        """Turn the cross-request caches on (a byte bound each) or off (None): the vision-feature cache
        (`Adapter.caches_vision` families) and the prefix cache. Answers are the same with and without them; what
        a request did not run costs it nothing. `trimvlm serve` turns both on. Returns `cache_stats()`."""
        ad = self.adapter
        ad.vision_cache = None
        if vision_bytes is not None and ad.caches_vision:
            ad.vision_cache = VisionCache(vision_bytes, ad.fingerprint(), self.runner.flops)
        self.runner.prefix_cache = None if prefix_bytes is None else PrefixCache(prefix_bytes)
        return self.cache_stats()

    def cache_stats(self) -> dict:
        """Per cache (`vision`, `prefix`): entries, bytes, bound, hits, misses, evictions; None when it is off."""
        caches = {"vision": self.adapter.vision_cache, "prefix": self.runner.prefix_cache}
        return {name: None if c is None else c.stats() for name, c in caches.items()}

    def info(self) -> dict:
        return self.adapter.info()


def load(path_or_id, dtype: torch.dtype | str = torch.float32, device: str = "cpu") -> VLM:
    """Load a supported checkpoint folder (or "demo", the shipped demo model) as a VLM, on `device` (cpu, cuda,
    cuda:N, mps) in `dtype` (a torch dtype or float32 | bfloat16 | float16)."""
    from trimvlm.loading import load_adapter

    return VLM(load_adapter(path_or_id, dtype=dtype, device=device))
