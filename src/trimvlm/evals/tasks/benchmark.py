"""A benchmark read from a local copy: what each benchmark file declares, and the loader that builds its Task.

A `Benchmark` names its columns (those of the lmms-lab parquet copy), its probe kind, its metric, its prompt
(the one lmms-eval gives it; `prompt` says it in words) and a `make(row, where)` that turns one row into the
record's fields. `load_benchmark` finds the split in the local copy (`trimvlm.data.layout`), checks the
columns, draws `limit` rows with `seed` (all rows without a limit; the drawn rows keep their file order),
decodes their images under a progress bar and returns the Task.
"""

from __future__ import annotations

import ast
import math
import random
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from trimvlm.data.layout import ImageOpener, find_source, image_present, iter_images, read_columns
from trimvlm.errors import InputError
from trimvlm.evals.metrics import OPTION_LETTERS
from trimvlm.evals.tasks.base import SHORT_INSTRUCTION, TASKS, Record, Task, TaskEntry, check_limit
from trimvlm.progress import steps


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    columns: tuple[str, ...]  # every record needs these (the image column included)
    make: Callable[[dict, str], dict]  # (row, where) -> question, answers, prompt, [options, kind]
    probe: str  # of every record (Record checks it and the metric)
    metric: str
    prompt: str  # the prompt format, in words (docs, errors)
    default_split: str
    optional: tuple[str, ...] = ()  # read when the copy has them (hint, category, ...)
    id_column: str | None = None
    image_column: str = "image"
    configs: tuple[str, ...] = ()  # configuration folders that hold it in a multi-config copy
    max_new_tokens: int = 32  # full-pipeline answers (lmms-eval's generation cap where it sets one)
    only_with_image: bool = False  # skip rows without an image (ScienceQA-IMG) instead of refusing them


def register_benchmark(bench: Benchmark) -> Benchmark:
    """Register the benchmark as a task of the one registry (read with `data=PATH`)."""
    about = f"{bench.title} ({bench.probe} probe, {bench.metric}; read with --data PATH)"
    TASKS[bench.name] = TaskEntry(bench.name, partial(load_benchmark, bench), about, reads_data=True)
    return bench


# --------------------------------------------------------------------------------------------- row helpers


def missing(value) -> bool:
    """None, NaN (pandas writes missing MMBench options as NaN or "nan") or an empty string."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, str) and value.strip() in ("", "nan")


def text(row: dict, column: str, where: str) -> str:
    value = row.get(column)
    if missing(value) or not isinstance(value, str | int | float):
        raise InputError(f"{where}: column {column!r} must hold a non-empty string, got {value!r:.80}")
    return str(value)


def answer_texts(row: dict, column: str, where: str) -> list[str]:
    """The reference answer(s) of `column`: a string or a list of strings, non-empty."""
    value = row.get(column)
    values = value if isinstance(value, list) else [value]
    out = [str(v) for v in values if not missing(v)]
    if not out:
        raise _no_answer(column, where)
    return out


def _no_answer(column: str, where: str) -> InputError:
    return InputError(
        f"{where}: no reference answer in column {column!r}; the test splits of several benchmarks "
        "withhold their answers (use a split that has them, e.g. --split validation or dev)"
    )


def open_answer(answers: str, *, kind: str | None = None, default_kind: str = "", prefix: str = "",
                suffix: str = "\n" + SHORT_INSTRUCTION):  # fmt: skip
    """The `make` of an open-answer benchmark: the question, its reference answers (column `answers`), the prompt
    `prefix + question + suffix`, and, with `kind`, that column as the record's kind (`default_kind` without)."""

    def make(row: dict, where: str) -> dict:
        question = text(row, "question", where)
        out = {"question": question, "answers": answer_texts(row, answers, where), "prompt": prefix + question + suffix}
        if kind is not None:
            out["kind"] = default_kind if missing(row.get(kind)) else str(row[kind])
        return out

    return make


def option_letter(index, n_options: int, where: str, column: str = "answer") -> str:
    """The letter of a 0-based answer index (an int or a digit string) among `n_options`."""
    if missing(index):
        raise _no_answer(column, where)
    try:
        k = int(str(index).strip())
    except ValueError:
        k = -1
    if not 0 <= k < n_options:
        raise InputError(f"{where}: answer {index!r} is not an option index 0..{n_options - 1}")
    return OPTION_LETTERS[k]


def string_list(row: dict, column: str, where: str, at_least: int = 2) -> list[str]:
    value = row.get(column)
    if isinstance(value, str) and value.startswith("["):  # a list written as text in some JSONL exports
        with suppress(ValueError, SyntaxError):
            value = ast.literal_eval(value)
    if not isinstance(value, list) or len(value) < at_least or any(missing(v) for v in value):
        raise InputError(
            f"{where}: column {column!r} must hold a list of >= {at_least} options, got {value!r:.80}"
        )
    return [str(v) for v in value]


# --------------------------------------------------------------------------------------------- loading


def load_benchmark(
    bench: Benchmark,
    data: str | Path,
    split: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Task:
    """The Task of benchmark `bench` from its local copy at `data` (see trimvlm.data.layout)."""
    limit = check_limit(limit)
    src = find_source(data, split, configs=bench.configs, default_split=bench.default_split, task=bench.name)
    absent = [c for c in bench.columns if c not in src.columns]
    if absent:
        optional = f" (and, if present: {', '.join(bench.optional)})" if bench.optional else ""
        raise InputError(
            f"{src.label} is not a {bench.title} layout: column(s) {', '.join(absent)} missing; expected "
            f"{', '.join(bench.columns)}{optional}; found: {', '.join(src.columns)}"
        )
    wanted = [c for c in (*bench.columns, *bench.optional, bench.id_column) if c and c in src.columns]
    meta = read_columns(src, [c for c in dict.fromkeys(wanted) if c != bench.image_column])
    rows = list(range(src.rows))
    if bench.only_with_image:
        present = image_present(src, bench.image_column)
        rows = [i for i in rows if present[i]]
        if not rows:
            raise InputError(f"{src.label}: no row has an image; {bench.title} keeps only rows with one")
    chosen = rows if limit is None or limit >= len(rows) else sorted(random.Random(seed).sample(rows, limit))
    opener = ImageOpener()
    records: list[Record] = []
    with steps(f"load {bench.name} ({src.split})", len(chosen), enabled=progress, unit="row") as bar:
        for i, raw, base in iter_images(src, bench.image_column, chosen):
            row = {c: values[i] for c, values in meta.items()}
            ident = row.get(bench.id_column) if bench.id_column else None
            rid = f"{src.split}-{i}" if missing(ident) else str(ident)
            where = f"{src.label}, row {i} (record {rid})"
            image = opener.open(raw, base, where)
            if image is None:
                raise InputError(
                    f"{where}: no image in column {bench.image_column!r}; every {bench.title} record needs one"
                )
            fields = bench.make(row, where)
            fields.setdefault("kind", bench.name)
            records.append(Record(id=rid, images=[image], probe=bench.probe, metric=bench.metric, **fields))
            bar.advance()
    selection = (
        "all rows"
        if len(chosen) == len(rows)
        else f"{len(chosen)} of {len(rows)} rows drawn with seed {seed}"
    )
    info = {"source": str(src.path), "form": src.form, "config": src.config, "split": src.split,
            "files": [str(f) for f in src.files], "rows": len(rows), "selection": selection, "seed": seed,
            "prompt": bench.prompt}  # fmt: skip
    return Task(
        name=bench.name, records=records, max_new_tokens=bench.max_new_tokens, prefill_tokens=1, info=info
    )
