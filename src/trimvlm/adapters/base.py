"""The Adapter protocol: everything trimvlm needs to know about one model family, and nothing more.

An adapter turns (images, prompts) into a `Prepared` batch and a `LiveSeq`, gives the rotary embeddings for
any position ids, runs one decoder layer, and owns the final norm and LM head. The runner, the methods and the
evaluation never look at model classes; they talk to this protocol.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image
from torch.nn.utils.rnn import pad_sequence

from trimvlm.errors import InputError, UnsupportedModelError
from trimvlm.kernels.flops import count
from trimvlm.runtime.cache import padded_cat
from trimvlm.runtime.layers import ATTENTION, LINEAR
from trimvlm.runtime.sequence import LiveSeq, next_positions

__all__ = ["ATTENTION", "LINEAR", "Adapter", "Conversation", "Prepared", "Turn"]


@dataclass
class Prepared:
    """A left-padded batch, with the tensors the model's own forward takes (`model_inputs`)."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] long
    model_inputs: dict  # everything else the model's forward needs (pixel_values, grids, ...)
    n_images: list[int] = field(default_factory=list)
    tiles: list[list[int]] = field(default_factory=list)  # tiled families: tiles of each image, per sample
    image_keys: list[list[int]] = field(default_factory=list)  # content fingerprint of each image, per sample
    resolution: object | None = None  # the `resolution` target the images were prepared at (None: as given)

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device) -> Prepared:
        """The same batch with every tensor on `device` (the model's): preprocessing builds it on the CPU."""
        device = torch.device(device)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.model_inputs.items()}
        return dataclasses.replace(
            self, input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device),
            model_inputs=inputs,
        )  # fmt: skip


class Images(NamedTuple):
    """What a family's image processor made of a batch's images (`Adapter.process_images`): the model inputs,
    per sample the prompt text of each image, per sample the tiles of each image (tiled families; None: none)."""

    inputs: dict
    blocks: list[list[str]]
    tiles: list[list[int]] | None = None


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: its role, its text and how many of the conversation's images it holds
    (given to `prepare` in the order of the turns)."""

    role: str  # "system", "user" or "assistant"
    text: str
    images: int = 0


@dataclass(frozen=True)
class Conversation:
    """A prompt of several messages (system text, earlier user and assistant turns, then the user turn the
    model answers): `Adapter.render_conversation` writes it in the model's prompt format."""

    turns: tuple[Turn, ...]

    def __post_init__(self):
        roles = [t.role for t in self.turns]
        body = roles[roles.count("system") :]
        if "system" in body:
            raise InputError(f"the messages are {roles}: system messages come first")
        if not body or body[-1] != "user" or any(r not in ("user", "assistant") for r in body):
            raise InputError(f"the messages are {roles}: after the system messages, user and assistant turns "
                             "ending with the user turn to answer")  # fmt: skip
        for t in self.turns:
            if not t.text.strip() and not (t.role == "user" and t.images):
                raise InputError(f"an empty {t.role} message: give its text")
            if t.images and t.role != "user":
                raise InputError(f"a {t.role} message holds images: only user messages may")

    def texts(self) -> list[str]:
        return [t.text for t in self.turns]


def _cat_padded(vals: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along axis 0, zero-padding the other axes up to the largest part's."""
    shape = [max(v.shape[d] for v in vals) for d in range(1, vals[0].dim())]
    widths = [[w for d in reversed(range(1, v.dim())) for w in (0, shape[d - 1] - v.shape[d])] for v in vals]
    padded = [torch.nn.functional.pad(v, w) if any(w) else v for v, w in zip(vals, widths, strict=True)]
    return torch.cat(padded)


def on_host(prepare):
    """Decorator of `Adapter.prepare`: preprocessing (image processor, tokenizer, padding) makes its tensors on
    the CPU whatever torch's default device is, and the batch it returns is handed to the model's device."""

    @functools.wraps(prepare)
    def wrapper(self, *args, **kwargs) -> Prepared:
        with torch.device("cpu"):
            prepared = prepare(self, *args, **kwargs)
        return prepared.to(self.device)

    return wrapper


_RESOLUTION: ContextVar = ContextVar("trimvlm_resolution", default=None)


@contextlib.contextmanager
def resolution(target):
    """Within this context (this thread only), `prepare` resizes every image whose natural LLM token grid is
    (h, w) so that it comes out at the grid `target(h, w)` (tokens=downsample); None: images as given. Only
    adapters with `resizes = True` honour it; the caller checks that first."""
    token = _RESOLUTION.set(target)
    try:
        yield
    finally:
        _RESOLUTION.reset(token)


current_resolution = _RESOLUTION.get  # the `resolution` target of the enclosing context, or None


def load_images(images, n_prompts: int | None = None) -> list[list[Image.Image]]:
    """Normalise per-sample image lists: a sample may be None, one image, a path, or a list of those.
    With `n_prompts`, there must be one image list per prompt."""
    if not isinstance(images, list | tuple):
        raise InputError(f"images must be a list with one entry per prompt, got {type(images).__name__}")
    if n_prompts is not None and len(images) != n_prompts:
        raise InputError(f"got {len(images)} image lists for {n_prompts} prompts; give one per prompt")
    samples = [[] if s is None else s if isinstance(s, list | tuple) else [s] for s in images]
    return [[_open(x) for x in s] for s in samples]


def image_keys(per_sample: list[list[Image.Image]]) -> list[list[int]]:
    """A 63-bit fingerprint of each image's pixels and size: the identity a seeded random choice draws from,
    so an image gets the same subset alone or in any batch, and different images different subsets."""
    return [[_key63(f"{im.size}{im.mode}", im.tobytes()) for im in ims] for ims in per_sample]


def pixel_key(pixels: torch.Tensor) -> int:
    """`image_keys`' fingerprint of one image already turned into pixel values (a decision request's images reach
    trimvlm through the processor): its shape and bytes."""
    data = pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return _key63(str(tuple(pixels.shape)), data)


def _key63(shape: str, data: bytes) -> int:
    h = hashlib.blake2b(shape.encode(), digest_size=8)
    h.update(data)
    return int.from_bytes(h.digest(), "little") >> 1


@functools.cache
def images_only_processor(name: str) -> type:
    """The processor class `name` built without a video processor: transformers checks every sub-processor's
    class, and the video processor's base class needs torchvision, which a decision request (images only) never
    uses. A subclass, so the check is relaxed for these objects only."""
    import transformers

    base = getattr(transformers, name)

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return base.check_argument_for_proper_class(self, argument_name, argument)

    relaxed = {"check_argument_for_proper_class": check_argument_for_proper_class}
    return type(f"{name}ImagesOnly", (base,), relaxed)


def checkpoint_meta(folder) -> dict | None:
    """A checkpoint folder's trimvlm.json (a demo model's prompt format, task, candidate marks); None: none."""
    path = None if folder is None else Path(folder) / "trimvlm.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _open(x) -> Image.Image:
    if isinstance(x, Image.Image):
        return x.convert("RGB")
    if not isinstance(x, str | os.PathLike):
        raise InputError(
            f"an image must be a PIL image or a file path, got a value of type {type(x).__name__} (a batch "
            "gives one entry per prompt: an image, a path, a flat list of them, or None)"
        )
    path = Path(x)
    if not path.exists():
        raise InputError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except Exception as e:  # PIL raises several types for unreadable files
        raise InputError(
            f"image unreadable: {path} is not an image file PIL can open ({type(e).__name__})"
        ) from e


class Adapter:
    """Base class. Subclasses set `family` and implement the abstract parts."""

    family: str = ""
    resizes = False  # `prepare` honours `resolution` (the family's token grid follows the image's size)
    rope_axes: int = 1
    # recurrent layers' kernel pads each row to a multiple of this many tokens (cost model of the tree layout)
    recurrent_chunk: int = 1
    caches_vision = False  # whether `embed` reads `vision_cache` (runtime/vision_cache.py) when one is set
    vision_cache = None  # a VisionCache, set by `VLM.use_caches` (serving); None: every image is encoded

    def __init__(self, model, tokenizer, image_processor, folder: Path | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.folder = folder
        meta = checkpoint_meta(folder)
        self.meta = meta or {}  # the checkpoint's trimvlm.json ({}: none)
        self.prompt_template = self.meta.get("prompt_template", "{prompt}")
        self.use_chat_template = meta is None and getattr(tokenizer, "chat_template", None) is not None
        linear = [[m for m in layer.modules() if isinstance(m, torch.nn.Linear)] for layer in self.layers]
        self._linear_macs = [sum(m.in_features * m.out_features for m in ms) for ms in linear]

    # ---- the model's parts; the defaults fit transformers' `XForConditionalGeneration` layout ----
    @property
    def inner(self):
        """The multimodal model under the LM head (`model.model`)."""
        return self.model.model

    @property
    def text_model(self):
        """The decoder stack: has `.layers`, `.norm`, `.rotary_emb`."""
        return self.inner.language_model

    @property
    def text_config(self):
        return self.model.config.text_config

    @property
    def layers(self) -> list[torch.nn.Module]:
        return self.text_model.layers

    @property
    def device(self) -> torch.device:
        """Where the model's weights live: `prepare` hands its batch over there."""
        return self.model.device

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor):
        return self.text_model.rotary_emb(hidden, positions if self.rope_axes > 1 else positions[0])

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text_model.norm(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    def lm_head_rows(self, hidden: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """The LM head's logits of only the tokens `token_ids` ([..., len(token_ids)]): the label logits of a
        decision readout, without the full vocabulary product."""
        head = self.model.lm_head
        ids = torch.tensor(token_ids, dtype=torch.long, device=head.weight.device)
        bias = None if head.bias is None else head.bias.index_select(0, ids)
        weight = head.weight.index_select(0, ids)
        return torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)

    # ---- decision requests (trimvlm/decision): the family's processor and a batch from its outputs ----
    # A decision model's head (adapters/jev.py), read instead of label logits; None for a plain VLM.
    decision_head = None
    # the decision config the model ships (a decision model's, read with its weights); None: read from the folder
    decision_config = None

    def processor_options(self) -> dict | None:
        """The options the family's transformers processor takes beside the image processor, tokenizer and chat
        template (`decision_processor`); None: decision requests are not wired for the family."""
        return None

    def decision_processor(self):
        """A fresh processor (or tokenizer, for a text-only model) for transformers' `decision.prepare_inputs`,
        over a copy of this adapter's tokenizer (prepare_inputs adds its sentinel tokens to it)."""
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

        options = self.processor_options()
        if options is None:
            raise UnsupportedModelError(
                f"decision requests are not wired for the {self.family} family yet; supported: qwen3_vl, "
                "qwen2_5_vl, qwen3_5, llava (and JevForDecision checkpoints over them)"
            )
        tokenizer = copy.deepcopy(self.tokenizer)
        if self.image_processor is None:  # a text-only backbone: transformers tokenizes with the tokenizer
            return tokenizer
        cls = images_only_processor(PROCESSOR_MAPPING_NAMES[self.model.config.model_type])
        chat_template = getattr(tokenizer, "chat_template", None)
        return cls(image_processor=self.image_processor, tokenizer=tokenizer, chat_template=chat_template, **options)

    @on_host
    def prepare_processed(self, inputs: list[dict]) -> Prepared:
        """A left-padded batch from the processor outputs of single prompts (`decision_processor`'s, each a
        batch of one with its sentinels dropped)."""
        ids, att = self.pad_batch([x["input_ids"][0].tolist() for x in inputs])
        given = [x for x in inputs if x.get("pixel_values") is not None]
        model_inputs = {}
        for k in ("pixel_values", *self.processed_image_inputs) if given else ():
            model_inputs[k] = torch.cat([x[k] for x in given])
        if given:
            model_inputs["pixel_values"] = model_inputs["pixel_values"].to(self.model.dtype)
        per_image = [self.processed_images(x) for x in inputs]
        return Prepared(
            ids, att, model_inputs | self.token_inputs(ids), n_images=[len(p) for p in per_image],
            image_keys=[[pixel_key(c) for c in p] for p in per_image],
        )  # fmt: skip

    processed_image_inputs: tuple[str, ...] = ()  # processor outputs concatenated beside the pixels

    def processed_images(self, inputs: dict) -> list[torch.Tensor]:
        """The pixels of each image of one processor output."""
        return [] if inputs.get("pixel_values") is None else list(inputs["pixel_values"])

    # ---- to implement per family ----
    def process_images(self, per_sample: list[list[Image.Image]]) -> Images:
        """The family's image processor over a batch's images (at least one)."""
        raise NotImplementedError

    def image_features(self, prepared: Prepared, probe, grids):
        """The vision tower's output for the batch's images (`pooler_output`: `get_image_features` on
        `vision_inputs`), with the probe's records (`_vision_units(rec, prepared, grids)`) when one is given."""
        call = lambda: self.inner.get_image_features(**self.vision_inputs(prepared), return_dict=True)  # noqa: E731
        return self.encode_vision(probe, call, lambda rec: self._vision_units(rec, prepared, grids), grids)

    def vision_inputs(self, prepared: Prepared) -> dict:
        """`get_image_features`' inputs; this default fits LLaVA and InternVL (feature layer and strategy from
        the config)."""
        cfg = self.model.config
        return {
            "pixel_values": prepared.model_inputs["pixel_values"], "vision_feature_layer": cfg.vision_feature_layer,
            "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
        }  # fmt: skip

    def vision_adds(self, out, embeds, visual) -> dict:
        """Per-position tensors the family adds after given layers (`LiveSeq.adds`; Qwen3-VL deepstack)."""
        return {}

    @on_host
    def prepare(self, images, prompts: list[str]) -> Prepared:
        """A left-padded batch of `prompts` (strings or `Conversation`s), one image entry per prompt."""
        per_sample = load_images(images, len(prompts))
        found = Images({}, [[] for _ in per_sample])
        if any(per_sample):
            found = self.process_images(per_sample)
        rows = [
            self.tokenize(self.render_prompt(prompt, len(ims), blocks.__getitem__))
            for ims, prompt, blocks in zip(per_sample, prompts, found.blocks, strict=True)
        ]
        ids, att = self.pad_batch(rows)
        return Prepared(
            ids, att, found.inputs | self.token_inputs(ids), n_images=[len(x) for x in per_sample],
            tiles=found.tiles or [[] for _ in per_sample], image_keys=image_keys(per_sample),
        )  # fmt: skip

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=not self.use_chat_template)["input_ids"]

    def token_inputs(self, ids: torch.Tensor) -> dict:
        """Model inputs read from the padded token ids (Qwen-VL's `mm_token_type_ids`)."""
        return {}

    def embed(self, prepared: Prepared, vision=None) -> LiveSeq:
        """The batch's live sequence: token embeddings with the image features written at the visual tokens
        (the vision tower runs here, with `vision`, a `VisionProbe`, recording), positions and layout."""
        embeds = self.embed_tokens(prepared.input_ids)
        visual, image_id, grids, starts = self.layout(prepared)
        adds = {}
        if "pixel_values" in prepared.model_inputs:
            out = self.image_features(prepared, vision, grids)
            embeds = self.merge_features(embeds, visual, out.pooler_output)
            adds = self.vision_adds(out, embeds, visual)
        positions = self.positions(prepared)
        return self.sequence_from(prepared, embeds, positions, visual, image_id, grids, starts, adds)

    def layout(self, prepared: Prepared):
        """Where the batch's images lie, read from the token ids and image grids alone: (visual [B, S] bool,
        image_id [B, S] (-1 on text), per sample the (h, w) grid of each unit, per sample each unit's first
        token index). `embed` builds its sequence on it."""
        raise NotImplementedError

    def layer_keys(self, i: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The key states attention layer i computes from `hidden` [..., D] entering it, before RoPE (a
        rotation: it leaves key norms unchanged), all KV heads concatenated: [..., Hk * hd]. None for a layer
        without attention keys. The projection is a method's own work, counted as method FLOPs."""
        layer = self.layers[i]
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "k_proj"):
            return None
        x = layer.input_layernorm(hidden)
        proj = attn.k_proj
        count(2 * x[..., 0].numel() * proj.in_features * proj.out_features)
        k = proj(x)
        norm = getattr(attn, "k_norm", None)
        if norm is not None:
            hd = getattr(attn, "head_dim", None) or self.text_config.head_dim
            k = norm(k.view(*k.shape[:-1], -1, hd)).flatten(-2)
        return k

    def vision_key(self, prepared: Prepared) -> tuple:
        """What the vision tower's FLOPs depend on: the shapes of the pixel tensors and the values of the
        image-grid tensors and the images per sample (never the prompts' token ids)."""
        key = [("n_images", tuple(prepared.n_images))]
        for k, v in sorted(prepared.model_inputs.items()):
            if not isinstance(v, torch.Tensor):
                continue
            if v.is_floating_point():
                key.append((k, tuple(v.shape)))
            elif "grid" in k:
                key.append((k, tuple(v.shape), tuple(v.flatten().tolist())))
        return tuple(key)

    def fingerprint(self) -> str:
        """What a cached vision feature depends on besides its image: the model (family, config, dtype, device,
        this very object) and the image processor's settings."""
        proc = self.image_processor
        settings = proc.to_json_string() if hasattr(proc, "to_json_string") else repr(proc)
        m, config = self.model, getattr(self.model, "config", None)
        config = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
        return f"{self.family}|{id(m)}|{getattr(m, 'dtype', '')}|{getattr(m, 'device', '')}|{config}|{settings}"

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    # ---- shared behaviour ----
    def layout_seq(self, prepared: Prepared) -> LiveSeq:
        """The batch's sequence as `embed` lays it out, with no vision tower run and no embedding (hidden is
        [B, S, 0], positions are zeros): what the shapes of a prefill follow from (`tune/predict.py`)."""
        visual, image_id, grids, starts = self.layout(prepared)
        b, s = visual.shape
        empty = torch.zeros(b, s, 0, device=visual.device)
        positions = torch.zeros(1, b, s, dtype=torch.long, device=visual.device)
        return self.sequence_from(prepared, empty, positions, visual, image_id, grids, starts)

    @functools.cached_property
    def layer_types(self) -> list[str]:
        """Per decoder layer its type (read once: the runner asks for it at every layer of every step)."""
        types = getattr(self.text_config, "layer_types", None)
        return list(types) if types else [ATTENTION] * len(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_positions(self) -> int | None:
        """The positions the model has (its text config's `max_position_embeddings`; None: no limit known), the
        one limit every check reads: generate (runtime/limits.py), score (scoring/layout.py), decide."""
        return getattr(self.text_config, "max_position_embeddings", None)

    def next_positions(self, prepared: Prepared) -> torch.Tensor:
        """[B] the position id each row's next token takes (`Runner.prefill`'s `next_pos`), from the batch alone,
        before any model work: one position per real token, unless the family's positions differ (M-RoPE)."""
        return next_positions(self.positions(prepared), prepared.attention_mask.bool())

    def processed_positions(self, inputs: dict) -> int:
        """The positions one processor output (a decision prompt, a batch of one) takes, on the host."""
        return int(inputs["input_ids"].shape[-1])

    def run_layer(self, i: int, hidden, position_embeddings, mask, cache, ctx, pad_mask2d=None):
        return self.layers[i](
            hidden, position_embeddings=position_embeddings, attention_mask=mask, cache=cache, trimvlm_ctx=ctx
        )

    def after_layer(self, index: torch.Tensor, seq: LiveSeq, hidden: torch.Tensor) -> torch.Tensor:
        """Family-specific additions after a decoder layer (Qwen3-VL deepstack). `index` [B] (long, on the host):
        per row, the layer's index among the layers that row ran, i.e. its `layer_idx` in the model with the
        skipped layers removed and renumbered (-1: the row skipped it). Default: nothing."""
        return hidden

    def text_positions(self, next_pos: torch.Tensor, n: int) -> torch.Tensor:
        """Position ids [A, B, n] of n text tokens following a sample whose next position is next_pos [B]."""
        pos = next_pos[:, None] + torch.arange(n, device=next_pos.device)[None]
        return pos[None].expand(self.rope_axes, -1, -1)

    def render_prompt(self, prompt, n_images: int, image_block) -> str:
        """The text of one prompt (a string: one user turn with its images; or a `Conversation`), each image
        written by `image_block(k)`."""
        if isinstance(prompt, str) and prompt.strip():
            prompt = Conversation((Turn("user", prompt, n_images),))
        if not isinstance(prompt, Conversation):
            raise InputError("empty prompt: give a non-empty question or instruction")
        return self.render_conversation(prompt, n_images, image_block)

    def render_conversation(self, conv: Conversation, n_images: int, image_block) -> str:
        """A conversation ending with a user turn, rendered for the next assistant turn. With a chat template:
        the template's own rendering (each user turn's images before its text). Without one (the demo
        models): every image first (in order), then the turns joined by spaces: each user turn through the
        prompt template (the first one preceded by the system text), each assistant turn as its text and the
        end-of-turn token. An earlier turn's prompt is then the start of a later turn's prompt."""
        if n_images != sum(t.images for t in conv.turns):
            raise InputError(f"the conversation holds {sum(t.images for t in conv.turns)} images, got {n_images}")
        if self.use_chat_template:
            messages = [
                {"role": t.role, "content": [{"type": "image"}] * t.images + [{"type": "text", "text": t.text}]}
                for t in conv.turns
            ]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            parts = text.split(self.chat_image_marker)  # each marker becomes that image's full block
            return parts[0] + "".join(image_block(k) + rest for k, rest in enumerate(parts[1:]))
        system = " ".join(t.text for t in conv.turns if t.role == "system")
        parts, first = [], True
        for t in conv.turns:
            if t.role == "user":
                q = f"{system} {t.text}" if first and system else t.text
                parts.append(self.prompt_template.format(prompt=q, question=q))
                first = False
            elif t.role == "assistant":
                parts.append(f"{t.text} {self.tokenizer.eos_token}")
        return "".join(image_block(k) for k in range(n_images)) + " ".join(parts)

    chat_image_marker: str = ""  # what a chat template writes for one image

    PER_TOKEN = ("mm_token_type_ids", "token_type_ids")  # model inputs with one entry per token, padded too

    def collate(self, parts: list[Prepared]) -> Prepared:
        """One left-padded batch from batches prepared apart (a server prepares each request alone, on its
        preparation thread, then runs them together): equal to preparing all their prompts at once. Per-token
        tensors are left-padded as `pad_batch` pads; every other tensor is concatenated along its first axis,
        its other axes zero-padded where the parts differ (images per sample: a zero image is padding)."""
        if len(parts) == 1:
            return parts[0]
        found = {p.resolution for p in parts}  # they must agree: one plan prepares them
        if len(found) > 1:
            raise InputError(f"a batch's parts were prepared at different resolutions ({sorted(map(repr, found))})")
        pad = self.tokenizer.pad_token_id
        inputs = {}
        for k in parts[0].model_inputs:
            vals = [p.model_inputs[k] for p in parts]
            if k in self.PER_TOKEN:
                inputs[k] = padded_cat(vals, 0, 1)
            elif isinstance(vals[0], torch.Tensor):
                inputs[k] = _cat_padded(vals)
            else:
                inputs[k] = vals[0]
        return Prepared(
            padded_cat([p.input_ids for p in parts], 0 if pad is None else pad, 1),
            padded_cat([p.attention_mask for p in parts], 0, 1),
            inputs,
            n_images=[n for p in parts for n in p.n_images],
            tiles=[t for p in parts for t in p.tiles],
            image_keys=[k for p in parts for k in p.image_keys],
            resolution=found.pop(),
        )

    def pad_batch(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, attention mask) of `rows` left-padded, built on the host (preprocessing: `prepare` moves
        the batch to the model's device)."""
        pad = self.tokenizer.pad_token_id
        seqs = [torch.tensor(r, dtype=torch.long, device="cpu") for r in rows]
        ids = pad_sequence(seqs, batch_first=True, padding_value=0 if pad is None else pad, padding_side="left")
        return ids, pad_sequence([torch.ones_like(t) for t in seqs], batch_first=True, padding_side="left")

    def sequence_from(
        self, prepared: Prepared, embeds, positions, visual, image_id, grids, starts, adds=None
    ):
        valid = prepared.attention_mask.bool()
        b, s = valid.shape
        tile_image = []
        for bi in range(b):  # per unit (tile) its image: without tiles, one unit per image
            n_units = len(grids[bi]) if bi < len(grids) else 0
            per_image = (prepared.tiles[bi] if bi < len(prepared.tiles) else None) or [1] * n_units
            tile_image.append([j for j, n in enumerate(per_image) for _ in range(n)][:n_units])
        source = torch.arange(s, device=valid.device)[None].expand(b, s).masked_fill(~valid, -1)
        return LiveSeq(
            hidden=embeds,
            positions=positions,
            valid=valid,
            visual=visual & valid,
            source=source,
            image_id=image_id,
            adds=adds or {},
            grids=grids,
            image_start=starts,
            size=torch.ones(b, s, dtype=torch.long, device=valid.device),
            tile_image=tile_image,
            image_keys=prepared.image_keys,
        )

    def positions(self, prepared: Prepared) -> torch.Tensor:
        """[1, B, S] 1-D position ids: the count of real tokens before each one, as transformers' `generate`
        computes them for a left-padded batch."""
        att = prepared.attention_mask
        return (att.long().cumsum(-1) - 1).masked_fill(att == 0, 0)[None]

    @staticmethod
    def unit_layout(visual: torch.Tensor, sizes: list[list[int]], offset: int = 0):
        """Units (images, or tiles) whose tokens are the visual tokens in order, per sample `sizes[b][j]` of them
        for unit j: (unit ids [B, S] (-1 on text), per sample the index of each unit's first token + `offset`)."""
        image_id = torch.full(visual.shape, -1, dtype=torch.long, device=visual.device)
        starts = []
        for b, counts in enumerate(sizes):
            idx, first = torch.nonzero(visual[b]).flatten(), 0
            starts.append([])
            for j, n in enumerate(counts):
                image_id[b, idx[first : first + n]] = j
                starts[b].append(int(idx[first]) + offset)
                first += n
        return image_id, starts

    def tile_layout(self, visual: torch.Tensor, grid: tuple[int, int], token: str):
        """Families whose images are runs of equal tiles (Idefics3, InternVL): (visual, tile ids [B, S] (-1 on
        text), per sample one `grid` per tile, the index of each tile's first token)."""
        n, grids = grid[0] * grid[1], []
        for b, found in enumerate(visual.sum(1).tolist()):
            if found and (n == 0 or found % n):
                raise InputError(
                    f"sample {b} has {found} {token} tokens, not a multiple of the {n} tokens of one "
                    f"tile; do not write {token} in a prompt, pass the images instead"
                )
            grids.append([grid] * (found // n if n else 0))
        image_id, starts = self.unit_layout(visual, [[n] * len(g) for g in grids])
        return visual, image_id, grids, starts

    @staticmethod
    def merge_features(embeds: torch.Tensor, visual: torch.Tensor, feats) -> torch.Tensor:
        """Write the image features (a tensor, or a list of per-image tensors), in order, at the visual positions
        of the text embeddings."""
        if isinstance(feats, list | tuple):
            feats = torch.cat(list(feats), dim=0)
        feats = feats.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        if feats.shape[0] != int(visual.sum()):
            raise InputError(
                f"{feats.shape[0]} image features for {int(visual.sum())} image tokens in the prompts"
            )
        return embeds.masked_scatter(visual[..., None], feats)

    # ---- vision-tower probe (PruMerge, VisionZip: runtime/vision_probe.py) ----
    @property
    def vision_config(self):
        return self.model.config.vision_config

    vision_has_cls = False  # the vision tower puts a [CLS] token first (its row is the probe's statistic)

    def vision_attention_modules(self) -> list[torch.nn.Module]:
        """The vision tower's attention modules, in layer order (each family says where they are)."""
        raise NotImplementedError(f"{self.family}: no vision-tower probe")

    def encode_vision(self, probe, encode, to_units, grids):
        """`encode()`, the family's vision-tower call. With a `VisionProbe`, the call runs recording the probe's
        layer, and `to_units(recording)` gives one `VisionUnit` per visual unit in batch order (images, or
        tiles), stored in `probe.results[(sample, unit)]` following `grids`."""
        if probe is None:
            return encode()
        from trimvlm.runtime.vision_probe import recording

        with recording(probe, self.vision_attention_modules(), cls=self.vision_has_cls) as rec:
            out = encode()
        units = to_units(rec)
        count(rec.flops)  # the records are complete
        flat = [(b, j) for b in range(len(grids)) for j in range(len(grids[b]))]
        if len(flat) != len(units):
            raise InputError(f"the vision tower encoded {len(units)} units, the prompts have {len(flat)}")
        probe.results.update(zip(flat, units, strict=True))
        return out

    # ---- cost accounting (matmul FLOPs of what ran) ----
    @functools.cached_property
    def _score_macs(self) -> int:
        """Heads x head_dim, read from the config once."""
        cfg = self.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_attention_heads * head_dim

    def layer_flops(self, i: int, batch: int, q: int, k: int) -> int:
        """Matmul FLOPs of layer i for `batch` rows of q queries over k keys (2 per multiply-add)."""
        flops = 2 * batch * q * self._linear_macs[i]
        if self.layer_types[i] == ATTENTION:
            flops += 4 * batch * q * k * self._score_macs
        else:
            flops += self.linear_layer_core_flops(i, batch, q)
        return flops

    def linear_layer_core_flops(self, i: int, batch: int, q: int) -> int:
        return 0

    def head_flops(self, batch: int, q: int) -> int:
        cfg = self.text_config
        return 2 * batch * q * cfg.hidden_size * cfg.vocab_size

    def visual_tokens(self, width: int, height: int) -> int:
        """LLM visual tokens one image of this size becomes (measured through `prepare`)."""
        blank = Image.new("RGB", (width, height), (128, 128, 128))
        return int((self.prepare([[blank]], ["x"]).input_ids == self.image_token_id).sum())

    @property
    def image_token_id(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "image_token_id", None) or cfg.image_token_index

    def info(self) -> dict:
        cfg = self.text_config
        visual = None
        if self.image_processor is not None:
            visual = [self.visual_tokens(128, 128), self.visual_tokens(448, 448)]
        return {
            "visual_tokens_per_image (128x128, 448x448)": visual or "text only",
            "family": self.family,
            "layers": self.num_layers,
            "layer_types": self.layer_types,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
        } | ({} if self.decision_head is None else {"decision_head": type(self.decision_head).__name__})
