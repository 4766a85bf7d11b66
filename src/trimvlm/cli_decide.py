"""`trimvlm decide`'s System One requests read from a JSON file, and `vlm.decide`'s answers printed as tables."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from trimvlm.errors import InputError
from trimvlm.terminal import Sheet


def read_requests(path: Path):
    """One request or a list of them from a JSON file. An asset that names a file is read relative to the
    request file's folder, never the current directory (an absolute path, or one leaving the folder with `..`,
    is read as given); base64 text, data URLs and System One asset dicts pass through."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise InputError(f"cannot read the request file {path}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"the request file {path} is not valid JSON: {e}") from e
    for req in data if isinstance(data, list) else [data]:
        assets = req.get("assets") if isinstance(req, dict) else None
        if isinstance(assets, dict):
            for name, value in assets.items():
                if isinstance(value, str):
                    assets[name] = _asset(name, value, path.parent)
    return data


def _asset(name: str, value: str, folder: Path) -> str:
    """A request file's string asset: a file named relative to `folder` as its path, base64 text as a data URL
    (so that it is never looked up as a file), a data URL as it is (text longer than any path, too); a file
    that is not there is an error."""
    if len(value) >= 4096 or value.startswith(("data:", "http://", "https://")):  # (a URL is refused later)
        return value
    given = Path(value).expanduser()
    found = given if given.is_absolute() else folder / given
    if found.is_file():
        return str(found)
    if _is_base64(value):
        return f"data:image/png;base64,{value}"
    where = "" if given.is_absolute() else f" in {folder} (a relative path is read from the request's folder)"
    raise InputError(f"asset {name!r}: no file {value}{where}; an asset is a path, base64 text or a data URL")


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode("".join(text.split()), validate=True)
    except binascii.Error:
        return False
    return bool(text.strip())


def _answer_text(answer: dict) -> str:
    kind = answer.get("type")
    if kind == "noul":
        return f"P(true) = {answer['noul']:.4f}"
    if kind == "choice":
        return str(answer["choice"])
    if kind == "score":
        return f"{answer['score']:.3f}"
    return json.dumps(answer)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def print_decisions(result, console, requests=None) -> None:
    """A table of answers per request and one line of its costs. `requests`: the requests as sent (their
    assets are the images counted; without them, the images the prompts carried)."""
    many = len(result.answers) > 1
    sent = requests if isinstance(requests, list) else [requests] * len(result.answers)
    for i, (answers, usage) in enumerate(zip(result.answers, result.usage, strict=True)):
        table = Sheet(console, f"request {i}" if many else None,
                      ["question", "type", "answer", "confidence", "probabilities"])  # fmt: skip
        for name, a in answers.items():
            probs = a.get("probabilities")
            probs = " ".join(f"{k}={v:.3f}" for k, v in probs.items()) if probs else ""
            conf = a.get("confidence")
            table.row(name, a["type"], _answer_text(a), "" if conf is None else f"{conf:.3f}", probs)
        console.print(table)
        images = len(sent[i].get("assets") or {}) if isinstance(sent[i], dict) else None  # the images it names
        images = (f"{_count(images, 'image')} ({usage.images} image inputs over the prompts)"
                  if images is not None and images != usage.images else _count(usage.images, "image input"))  # fmt: skip
        console.print(
            f"[dim]{_count(usage.prompts, 'prompt')}, {usage.input_tokens} input tokens, {images}; "
            f"{usage.model_flops / 1e9:.4f} GFLOP model + {usage.method_flops / 1e9:.6f} method, "
            f"KV {usage.kv_bytes / 1024:.1f} KiB, {usage.latency_s * 1e3:.0f} ms[/]"
        )
    c = result.costs
    if many:
        console.print(
            f"[dim]batch: {len(result.answers)} requests, {c.model_flops / 1e9:.4f} GFLOP model, "
            f"{sum(c.seconds.values()) * 1e3:.0f} ms forward, recipe {result.recipe}[/]"
        )
