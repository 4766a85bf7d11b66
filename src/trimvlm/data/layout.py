"""Finding and reading a benchmark's local copy: Hugging Face datasets parquet shards, or JSONL + images.

Accepted layouts (`--data PATH`; PATH a folder, or one `.parquet` / `.jsonl` file):

- parquet shards as the Hugging Face hub publishes datasets (the lmms-lab copies among them), read with
  pyarrow: `data/<split>-00000-of-00003.parquet`, `<config>/<split>-00000-of-00001.parquet` (a dataset with
  several configurations, e.g. DocVQA/ and InfographicVQA/), `<config>/<split>/0000.parquet` (the hub's
  parquet conversion), or `<split>.parquet`. The image column is the `datasets` Image feature: a struct
  {bytes, path} with the encoded file embedded in `bytes` (a `path` alone is read relative to PATH); plain
  binary or a path string are accepted too.
- JSONL: `<split>.jsonl` (or `data/<split>.jsonl`, `<config>/<split>.jsonl`), one row per line with the
  same columns as the parquet form; the image column holds a file path relative to the JSONL file's folder
  (or a {"path": ...} object).

The split of a file is the part of its name before `-NNNNN-of-NNNNN` (or its folder's name for `0000.parquet`
files); its configuration is the folder it lies in below PATH (`data/` does not count). Folders whose name
starts with a dot are ignored. When PATH holds parquet shards, JSONL files beside them are ignored.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from trimvlm.errors import InputError

SHARD = re.compile(r"(?P<split>.+?)-\d{5}-of-\d{5}")
FORMS = {".parquet": "parquet", ".jsonl": "jsonl"}
EXPECTED = (
    "parquet shards as Hugging Face datasets publish them (data/<split>-00000-of-0000N.parquet, or "
    "<config>/<split>-....parquet) or <split>.jsonl with image files"
)


@dataclass
class Source:
    """One split of one configuration of a local dataset copy."""

    path: Path  # what was given
    form: str  # "parquet" | "jsonl"
    config: str  # "" when the copy has one configuration
    split: str
    files: list[Path]
    columns: list[str]
    rows: int
    _jsonl: list[dict] | None = None  # the JSONL rows, read once

    @property
    def label(self) -> str:
        config = f", config {self.config}" if self.config else ""
        return f"{self.path} (split {self.split}{config})"

    def base_dir(self, file: Path) -> Path:
        """Where relative image paths of `file` start: the JSONL file's folder, or PATH for parquet."""
        if self.form == "jsonl":
            return file.parent
        return self.path if self.path.is_dir() else self.path.parent


def _split_and_config(file: Path, root: Path) -> tuple[str, str]:
    parts = list(file.parent.relative_to(root).parts) if file.parent != root else []
    if file.stem.isdigit() and parts:  # <config>/<split>/0000.parquet
        split = parts.pop()
    else:
        m = SHARD.fullmatch(file.stem)
        split = m["split"] if m else file.stem
    return split, "/".join(p for p in parts if p != "data")


def _listing(root: Path, limit: int = 12) -> str:
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    if not names:
        return "nothing (an empty folder)"
    more = f", ... ({len(names)} files)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _files(root: Path) -> tuple[str, dict[tuple[str, str], list[Path]]]:
    """(form, {(config, split): files}) of the dataset at `root`."""
    if root.is_file():
        form = FORMS.get(root.suffix)
        if form is None:
            raise InputError(
                f"{root} is not a benchmark file: expected a .parquet or .jsonl file, or a folder"
            )
        split, _ = _split_and_config(root, root.parent)
        return form, {("", split): [root]}
    for suffix, form in FORMS.items():
        found: dict[tuple[str, str], list[Path]] = {}
        for f in sorted(root.rglob(f"*{suffix}")):
            rel = f.relative_to(root).parts
            if any(p.startswith(".") for p in rel) or len(rel) > 4:
                continue
            split, config = _split_and_config(f, root)
            found.setdefault((config, split), []).append(f)
        if found:
            return form, found
    raise InputError(f"{root} is not a known benchmark layout: expected {EXPECTED}; found: {_listing(root)}")


def find_source(
    path: str | Path,
    split: str | None = None,
    *,
    configs: Sequence[str] = (),
    default_split: str | None = None,
    task: str = "the task",
) -> Source:
    """The one (configuration, split) of the copy at `path` to read. A copy with several configurations
    takes the first of `configs` it holds; the split is `split`, else `default_split` if held, else the
    only one."""
    root = Path(path).expanduser()
    if not root.exists():
        raise InputError(f"benchmark data not found: {root} does not exist (give --data a folder or file)")
    form, found = _files(root)
    held = sorted({c for c, _ in found})
    if len(held) == 1:
        config = held[0]
    else:
        preferred = [c for c in configs if c in held]
        if not preferred:
            names = ", ".join(c or "(top level)" for c in held)
            wanted = " or ".join(configs) if configs else "one of them"
            raise InputError(
                f"{root} holds several configurations ({names}); {task} reads {wanted}: "
                f"give --data {root}/<configuration>"
            )
        config = preferred[0]
    splits = sorted(s for c, s in found if c == config)
    where = f"{root}" + (f" (config {config})" if config else "")
    if split is not None:
        if split not in splits:
            raise InputError(f"split {split!r} not found in {where}; found: {', '.join(splits)}")
    elif default_split in splits:
        split = default_split
    elif len(splits) == 1:
        split = splits[0]
    else:
        raise InputError(f"{where} holds the splits {', '.join(splits)}: choose one with --split")
    files = found[(config, split)]
    src = Source(path=root, form=form, config=config, split=split, files=files, columns=[], rows=0)
    if form == "parquet":
        import pyarrow.parquet as pq
        try:
            metas = [pq.ParquetFile(f) for f in files]
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a broken file
            raise InputError(f"{where}: a parquet shard cannot be read ({type(e).__name__}: {e})") from None
        src.columns = list(metas[0].schema_arrow.names)
        src.rows = sum(m.metadata.num_rows for m in metas)
    else:
        src._jsonl = _read_jsonl(files)
        src.columns = list(dict.fromkeys(k for row in src._jsonl for k in row if k != "__file__"))
        src.rows = len(src._jsonl)
    if src.rows == 0:
        raise InputError(f"{src.label} holds no rows")
    return src


def _read_jsonl(files: list[Path]) -> list[dict]:
    return [{**obj, "__file__": f} for f in files for _, obj in jsonl_objects(f)]


def jsonl_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) per line of a JSONL file, blank lines and lines starting with `#` skipped; a line
    that is not a JSON object stops it with InputError "<path>:<line>: ...". Lines are read as they are asked
    for (a caller that stops early never reads the rest)."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def read_columns(src: Source, names: Sequence[str]) -> dict[str, list]:
    """The values of the columns `names` (not the image column) for every row, in file order."""
    if src.form == "jsonl":
        return {n: [row.get(n) for row in src._jsonl] for n in names}
    import pyarrow.parquet as pq
    out: dict[str, list] = {n: [] for n in names}
    for f in src.files:
        try:
            table = pq.read_table(f, columns=list(names))
        except Exception as e:
            raise InputError(
                f"{src.label}: shard {f.name} cannot be read with the columns {list(names)} "
                f"({type(e).__name__}: {e}); every shard of a split needs the same columns"
            ) from None
        for n in names:
            out[n] += table.column(n).to_pylist()
    return out


def _row_groups(src: Source) -> list[tuple[Any, Path, int, int, int]]:
    """(parquet file, its path, row group, first row, rows) over the split, in order."""
    import pyarrow.parquet as pq
    out, start = [], 0
    for f in src.files:
        pf = pq.ParquetFile(f)
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            out.append((pf, f, g, start, n))
            start += n
    return out


def image_present(src: Source, column: str) -> list[bool]:
    """Per row: does the image column hold an image (embedded bytes or a path)?"""
    if src.form == "jsonl":
        return [_has_image(row.get(column)) for row in src._jsonl]
    import pyarrow as pa
    import pyarrow.compute as pc

    out: list[bool] = []
    for pf, _, g, _, _ in _row_groups(src):
        arr = pf.read_row_group(g, columns=[column]).column(column).combine_chunks()
        valid = arr.is_valid()
        if pa.types.is_struct(arr.type):  # the datasets Image struct: bytes or a path must be set
            held = [
                pc.is_valid(pc.struct_field(arr, f.name)) for f in arr.type if f.name in ("bytes", "path")
            ]
            if held:
                valid = pc.and_(valid, held[0] if len(held) == 1 else pc.or_(held[0], held[1]))
        out += [bool(v) for v in valid.to_pylist()]
    return out


def _has_image(value) -> bool:
    if isinstance(value, dict):
        return bool(value.get("bytes") or value.get("path"))
    return bool(value)


def iter_images(src: Source, column: str, rows: Sequence[int]) -> Iterator[tuple[int, Any, Path]]:
    """(row, raw image value, the folder its relative paths start from) for the given rows (ascending),
    reading only the row groups that hold them, one at a time."""
    if src.form == "jsonl":
        for i in rows:
            yield i, src._jsonl[i].get(column), src.base_dir(src._jsonl[i]["__file__"])
        return
    for pf, f, g, start, n in _row_groups(src):
        local = [i - start for i in rows[bisect_left(rows, start) : bisect_left(rows, start + n)]]
        if local:
            values = pf.read_row_group(g, columns=[column]).column(column).take(local).to_pylist()
            for j, v in zip(local, values, strict=True):
                yield start + j, v, src.base_dir(f)


class ImageOpener:
    """Turns raw image values into images the model can take, each checked to decode now (a broken image
    stops the load, never the run). Embedded bytes become a lazily decoded PIL image (identical bytes share
    one); a path stays a path."""

    def __init__(self):
        self._seen: dict[bytes, Image.Image] = {}

    def open(self, raw, base: Path, where: str):
        """The image of `raw`, or None when the row has none."""
        data, path = None, None
        if isinstance(raw, dict):
            data, path = raw.get("bytes"), raw.get("path")
        elif isinstance(raw, bytes | bytearray | memoryview):
            data = bytes(raw)
        elif isinstance(raw, str):
            path = raw
        elif raw is not None:
            raise InputError(
                f"{where}: the image column holds a {type(raw).__name__}; expected the datasets Image struct "
                "{bytes, path}, encoded image bytes, or a file path"
            )
        if data:
            key = hashlib.blake2b(data, digest_size=16).digest()
            if key not in self._seen:
                self._check(lambda: Image.open(io.BytesIO(data)), f"{where}: the embedded image")
                self._seen[key] = Image.open(io.BytesIO(data))
            return self._seen[key]
        if path:
            p = Path(path).expanduser()
            p = p if p.is_absolute() else base / p
            if not p.is_file():
                raise InputError(f"{where}: image file not found: {p} (paths are relative to {base})")
            self._check(lambda: Image.open(p), f"{where}: image {p}")
            return p
        return None

    @staticmethod
    def _check(opener, what: str) -> None:
        try:
            with opener() as im:
                im.load()
        except Exception as e:  # PIL raises several types for unreadable data
            raise InputError(
                f"{what} cannot be decoded ({type(e).__name__}); give a PNG/JPEG/... image PIL can open"
            ) from None
