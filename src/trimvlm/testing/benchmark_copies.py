"""Tiny benchmark copies written the way they are distributed: Hugging Face datasets parquet shards (the
image column the `datasets` Image feature: a {bytes, path} struct with the encoded PNG embedded, declared an
Image in the schema's `huggingface` metadata, so `datasets` (and lmms-eval's tasks) decode it to PIL images
while trimvlm's loaders read the struct with pyarrow) or <split>.jsonl with image files. Used by the loader
tests, the lmms-eval bridge tests and benchmarks/fixture_benchmark.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from trimvlm.testing import random_image

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
# what `datasets` reads the column as; the other columns' features are those datasets infers from arrow types
IMAGE_FEATURE = {"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}}}})}


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image(i: int, size=(48, 40)) -> Image.Image:
    return random_image(i, size)


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 2) -> Path:
    """One shard; PIL images in column "image" are embedded as the datasets Image feature (None stays null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {}
    for name in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(name) for r in rows]
        if name == "image":
            values = [None if v is None else {"bytes": png(v), "path": f"{k}.png"}
                      for k, v in enumerate(values)]  # fmt: skip
        columns[name] = pa.array(values, type=IMAGE if name == "image" else None)
    table = pa.table(columns)
    if "image" in columns:
        table = table.replace_schema_metadata(IMAGE_FEATURE)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_shards(folder: Path, split: str, rows: list[dict], shards: int = 2, config: str = "data") -> Path:
    """`folder/<config>/<split>-0000k-of-0000n.parquet`, the rows cut into `shards` files."""
    per = -(-len(rows) // shards)
    for k in range(shards):
        write_parquet(
            folder / config / f"{split}-{k:05d}-of-{shards:05d}.parquet", rows[k * per : (k + 1) * per]
        )
    return folder


def write_jsonl(folder: Path, split: str, rows: list[dict]) -> Path:
    """`folder/<split>.jsonl` + `folder/images/<k>.png`; the image column holds the relative path."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, r in enumerate(rows):
        r = dict(r)
        if r.get("image") is not None:
            r["image"].save(folder / "images" / f"{split}-{k}.png")
            r["image"] = f"images/{split}-{k}.png"
        lines.append(json.dumps(r))
    (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def pope_rows(n: int = 6) -> list[dict]:
    """POPE's columns over demo-task images and their "is there a ..." questions (answers yes / no)."""
    from trimvlm.demo.task import generate_split

    rows = []
    for i, s in enumerate(generate_split("test", n, seed=0)):
        qa = next(q for q in s.qas if q.kind == "exist")
        rows.append({"id": i, "question_id": f"q{i}", "question": qa.question, "answer": qa.answer,
                     "image_source": f"img{i}", "image": s.image,
                     "category": ("adversarial", "popular", "random")[i % 3]})  # fmt: skip
    return rows
