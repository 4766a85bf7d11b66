"""The `trimvlm` command."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from trimvlm.errors import InputError, TrimVLMError
from trimvlm.terminal import Col, Sheet, Terminal

app = typer.Typer(
    add_completion=False, no_args_is_help=True,
    help="Cheaper VLM inference, honestly measured. New here? `trimvlm demo-image scene.png`, then `trimvlm "
    "generate --model demo --image scene.png --prompt \"how many blue ?\"`; `trimvlm methods` lists the recipes.",
)  # fmt: skip
USE, MEASURE, TRAIN = "Use a model", "Measure and choose recipes", "Train and calibrate (writes files)"


def package_version() -> str:
    """The installed distribution's version (its metadata), or the source's `trimvlm.__version__` where trimvlm
    runs without being installed (a checkout on PYTHONPATH)."""
    try:
        return importlib.metadata.version("trimvlm")
    except importlib.metadata.PackageNotFoundError:
        from trimvlm import __version__

        return __version__


def _version(value: bool) -> None:
    if value:
        print(f"trimvlm {package_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version"),
) -> None:
    """Cheaper VLM inference, honestly measured."""
    global console
    console = Terminal()  # per run: the width of this run's terminal, COLUMNS or the pipe (trimvlm.terminal)


console = Terminal()
err_console = Console(stderr=True)


def _wide(wide: bool) -> None:
    """--wide: this run's tables show every column (set while the command's options are read)."""
    global console
    if wide:
        console = Terminal(wide=True)


WIDE = typer.Option(False, "--wide", callback=_wide, help="every column of the tables, each as wide as it needs "
                    "(default: the columns that matter, fitting the terminal; --json holds every number)")  # fmt: skip


def _fail(e: TrimVLMError):
    """Bad input: one line on stderr (never a traceback), exit status 2."""
    err_console.print(f"[bold red]error:[/] {escape(' '.join(str(e).split()))}", soft_wrap=True)
    raise typer.Exit(2)


def command(*args, **kw):
    """`app.command`, its bad input (a TrimVLMError) reported by `_fail`. A parameter `load_kw` (`LOAD_KW`)
    stands for the options --device and --dtype (`DEVICE`, `DTYPE`): the command gets them checked, as
    trimvlm.load's keywords (`_load_kw`)."""

    def register(fn):
        sig = inspect.signature(fn, eval_str=True)

        @functools.wraps(fn)
        def run(*a, **k):
            try:
                if "load_kw" in sig.parameters:
                    k["load_kw"] = _load_kw(k.pop("device"), k.pop("dtype"))
                return fn(*a, **k)
            except TrimVLMError as e:
                _fail(e)

        params = [q for p in sig.parameters.values() for q in (LOAD_OPTIONS if p.name == "load_kw" else [p])]
        run.__signature__ = sig.replace(parameters=params)
        return app.command(*args, **kw)(run)

    return register


def _write_json(path: Path | None, data) -> None:
    if path is None:
        return
    try:
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror}") from None
    console.print(f"[dim]wrote {path}[/]")


JSON_OUT = typer.Option(None, "--json", help="also write the results as JSON to this file")
DEVICE = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N | mps")
DTYPE = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16")
LOAD_KW = None  # a command's `load_kw: dict = LOAD_KW`: its --device and --dtype (`command`)
LOAD_OPTIONS = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=str)
                for name, option in (("device", DEVICE), ("dtype", DTYPE))]  # fmt: skip
MODEL = typer.Option(
    "demo", "--model",
    help="a supported checkpoint folder (decide and serve: also a JevForDecision) or a shipped demo model: demo, "
    "demo-qwen35; loaded with --device and --dtype",
)  # fmt: skip
OVERWRITE = typer.Option(False, "--overwrite", help="allow writing into a shipped demo checkpoint")
ROUTER = typer.Argument(..., help="a v2 router folder, or a demo model's name (its shipped router)")


def TASK(what: str):  # noqa: N802 (an option, as MODEL and DEVICE)
    """--task, defaulting to the checkpoint's own task (`_task`)."""
    return typer.Option(None, help=f"{what}; default: the checkpoint's own task")


def RAY(what: str):  # noqa: N802 (an option, as TASK)
    """--ray: `what` over Ray, on a cluster given as auto, local or HOST:PORT."""
    return typer.Option(None, "--ray", help=f"{what} over Ray: auto (the running cluster), local, or HOST:PORT")


def WORKERS(scope: str):  # noqa: N802 (an option, as TASK)
    return typer.Option(None, help=f"with --ray: workers, each loads the model once{scope} (default: one per GPU, "
                        "else per CPU)")  # fmt: skip


def _warn_unknown(vlm, text: str) -> None:
    """Most of a prompt's words unknown to the model: the library's UnknownWordsWarning as one line on stderr
    (the answer is then a guess); the library's own warning is then left out."""
    import warnings

    from trimvlm.vlm import UnknownWordsWarning, warn_unknown_words

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", UnknownWordsWarning)
        warn_unknown_words(vlm.tokenizer, text)
    warnings.filterwarnings("ignore", category=UnknownWordsWarning)
    for w in (w for w in seen if issubclass(w.category, UnknownWordsWarning)):
        err_console.print(f"[yellow]warning:[/] {escape(str(w.message))}", soft_wrap=True)


def _load_kw(device: str, dtype: str) -> dict:
    """Checked --device / --dtype for trimvlm.load (bad values: the one-line error)."""
    from trimvlm.loading import parse_device, parse_dtype

    return {"device": str(parse_device(device)), "dtype": parse_dtype(dtype)}


def _numbers(option: str, text, what: str = "comma-separated fractions,", within=None) -> list[float]:
    """The comma-separated numbers of `option`'s `text`, each strictly `within` (low, high) where given, else
    InputError "<option> must be <what> got <text>"."""
    try:
        values = [float(x) for x in str(text).split(",")]
    except ValueError:
        values = []
    if not values or (within is not None and not all(within[0] < v < within[1] for v in values)):
        raise InputError(f"{option} must be {what} got {text!r}")
    return values


@command(rich_help_panel=USE)
def generate(
    model: str = MODEL,
    image: list[Path] = typer.Option([], help="image file (repeat for several images)"),
    prompt: str = typer.Option(..., help="question or instruction"),
    max_new_tokens: int = typer.Option(32, help="maximum new tokens"),
    recipe: str = typer.Option("", help="e.g. tokens=density:keep=0.25:layer=3"),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    json_out: Path | None = JSON_OUT,
    load_kw: dict = LOAD_KW,
):
    """Generate an answer for one image + prompt."""
    import trimvlm

    vlm = trimvlm.load(model, **load_kw)
    _warn_unknown(vlm, prompt)
    res = vlm.generate(
        [str(p) for p in image], prompt, recipe=recipe or None, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, seed=seed,
    )  # fmt: skip
    console.print(res.texts[0], markup=False)
    c = res.costs
    console.print(
        f"[dim]prefill {c.prefill_flops / 1e9:.3f} GFLOP, decode {c.decode_flops / 1e9:.3f} GFLOP, "
        f"KV {c.kv_bytes / 1024:.1f} KiB, {sum(c.seconds.values()) * 1e3:.0f} ms[/]"
    )
    _write_json(json_out, {"text": res.texts[0], "tokens": res.tokens[0], "recipe": res.recipe,
                           "costs": res.costs.as_dict()})  # fmt: skip


@command(rich_help_panel=USE)
def info(
    model: str = MODEL, json_out: Path | None = JSON_OUT,
    load_kw: dict = LOAD_KW,
):
    """Family, layers and their types, visual tokens per image."""
    import trimvlm

    vlm = trimvlm.load(model, **load_kw)
    data = vlm.info()
    table = Sheet(console, f"{model}", ["field", "value"])
    for k, v in data.items():
        table.row(k, ", ".join(map(str, v)) if isinstance(v, list) else str(v))
    console.print(table)
    _write_json(json_out, data)


@command(rich_help_panel=USE)
def methods(json_out: Path | None = JSON_OUT):
    """Every registered method, per recipe axis: its options (type, default) and what it does."""
    from trimvlm.registry import describe_methods

    data = describe_methods()  # a method plugin that fails to load: the one-line error
    for axis, entries in data.items():
        table = Sheet(console, f"{axis}=", ["method", "options (type = default)", "what it does"], show_lines=True)
        for m in entries:
            opts = "\n".join(f"{o['name']}: {o['type']} = {o['default']!r}" for o in m["options"])
            table.row(m["name"], opts, m["summary"])
        console.print(table)
    variants = _router_variants()
    if variants:
        table = Sheet(console, "router=M:budget=B (no other option) runs the variant recorded for the nearest budget",
                      ["model", "budget", "select=", "price=", "aim=", "val accuracy"])  # fmt: skip
        for name, v in variants:
            runs = v.get("routes", [v])  # a routed variant: each input on one of its routes
            table.row(name, f"{v['budget']}", " | ".join(r["select"] for r in runs),
                      " | ".join(str(r["price"]) for r in runs), " | ".join(f"{r.get('aim', v['budget']):.4g}" for r in runs),
                      f"{100 * v['val_accuracy']:.1f}% ({v['val_items']} items)")  # fmt: skip
        console.print(table)
    console.print(TUNED_AND_START)
    _write_json(json_out, data)


def _router_variants() -> list[tuple[str, dict]]:
    """(demo model, variant) recorded in each shipped router (`trimvlm pick-router`)."""
    from trimvlm.loading import DEMO_MODELS
    from trimvlm.router.model import load_router

    first: dict[str, str] = {}
    for name, folder in DEMO_MODELS.items():  # aliases share a folder: each router once, by its first name
        first.setdefault(folder, name)
    out = []
    for name in first.values():
        try:
            _, meta = load_router(name)
        except TrimVLMError:
            continue
        out += [(name, v) for v in meta.get("budget", {}).get("variants", [])]
    return out


TUNED_AND_START = (
    "[bold]tuned=[/]FOLDER:budget=RATIO  a `trimvlm tune` result: the best recipe it found for that budget "
    "(e.g. tuned=runs/tune:budget=0.75)\n\n"
    "Where to start: give a budget, not knobs: `trimvlm tune --model M --task T --budget total_flops=0.75`. By "
    "hand: tokens=density:keep=0.5:layer=2 (or dart) inside the model, tokens=visionzip:keep=0.5 before it, "
    "kv=snapkv:keep=0.5 for long answers; `trimvlm eval` compares recipes on your task."
)


@command(rich_help_panel=MEASURE)
def demo(
    limit: int = typer.Option(300, help="test items"),
    json_out: Path = typer.Option(Path("trimvlm-demo.json"), "--json"),
    plot: Path = typer.Option(Path("trimvlm-demo.png")),
    load_kw: dict = LOAD_KW,
    wide: bool = WIDE,
):
    """The main job: the shipped demo model on the demo task, baseline and a few recipes side by side."""
    from trimvlm.cli_eval import demo_command

    demo_command(limit=limit, json_out=str(json_out), png_out=str(plot), load_kw=load_kw,
                 console=console)


@command("demo-image", rich_help_panel=USE)
def demo_image(
    out: Path = typer.Argument(Path("scene.png"), help="PNG file to write"),
    seed: int = typer.Option(0, help="which scene"),
):
    """Write a demo scene (the image the demo models read) and print the questions they answer about it."""
    from trimvlm.demo.task import make_sample, split_rng

    sample = make_sample(split_rng("test", seed))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        sample.image.save(out)
    except OSError as e:
        raise InputError(f"cannot write {out}: {e.strerror or e}") from None
    table = Sheet(console, f"{out}: questions the demo models answer (seed {seed})", ["question", "answer"])
    for q in sample.qas:
        table.row(q.question, q.answer)
    console.print(table)
    console.print(f'[dim]e.g. trimvlm generate --model demo --image {out} --prompt "{sample.qas[0].question}"[/]')


def _task(model: str, task: str | None) -> str:
    """--task, or the checkpoint's own demo task (its trimvlm.json: `scenes` for demo-scenes) when not given."""
    from trimvlm.loading import checkpoint_task

    return task if task is not None else checkpoint_task(model)


def _tasks_epilog() -> str:
    from trimvlm.cli_eval import task_list

    return "Tasks (--task; or PATH.jsonl):\n\n" + "\n\n".join(task_list().splitlines())


@command("eval", epilog=_tasks_epilog(), rich_help_panel=MEASURE)
def eval_(
    model: str = MODEL,
    task: str | None = TASK("a registered task (listed below) or PATH.jsonl"),
    data: str | None = typer.Option(
        None, help="a benchmark's local copy: Hugging Face parquet shards or <split>.jsonl + images"
    ),
    split: str | None = typer.Option(None, help="the benchmark split to read (default: its usual one)"),
    recipes: Path | None = typer.Option(None, help="YAML/JSON recipe file"),
    recipe: list[str] = typer.Option(
        [], help="an inline recipe, e.g. tokens=density:keep=0.5:layer=3 (repeat)"
    ),
    limit: int | None = typer.Option(
        None, help="how many items (default: the whole task; demo: 300; a benchmark: N rows drawn with --seed)"
    ),
    threads: int | None = typer.Option(None, help="torch threads (default: torch's)"),
    max_new_tokens: int | None = typer.Option(None, help="cap of generated tokens of full-answer items"),
    json_out: Path | None = typer.Option(None, "--json", help="write the results JSON here"),
    plot: Path | None = typer.Option(None, help="write the Pareto plot (PNG) here"),
    batch_size: int = typer.Option(16),
    seed: int = typer.Option(0),
    markdown: Path | None = typer.Option(None, help="also write a Markdown summary table here"),
    readout: str = typer.Option("auto", help="candidate items (demo-candidates) only: auto | loglik | head"),
    ray: str | None = RAY("shard the items"),
    workers: int | None = WORKERS(""),
    device: str | None = typer.Option(
        None, "--device", help="cpu | cuda | cuda:N | mps (default cpu; with --ray: a GPU per worker if any)"
    ),
    wide: bool = WIDE,
    dtype: str = DTYPE,
):
    """Evaluate recipes on a task: accuracy, mismatch / agreement and retention vs the uncompressed model, costs
    (FLOPs, KV after eviction and KV peak, latency). Benchmarks read a local copy with --data PATH [--split S]
    (docs/benchmarks.md)."""
    from trimvlm.cli_eval import eval_command

    load_kw = _load_kw(device or "cpu", dtype)
    if ray is not None and device is None:  # each Ray worker: its own GPU when the cluster has GPUs
        load_kw.pop("device")
    eval_command(
        model, _task(model, task), recipes, limit, json_out, plot, batch_size, seed, max_new_tokens=max_new_tokens,
        markdown_out=markdown, readout=readout, recipes=list(recipe), load_kw=load_kw, data=data, split=split,
        ray=ray, workers=workers, console=console, threads=threads,
    )  # fmt: skip


@command("train-demo", rich_help_panel=TRAIN)
def train_demo(
    out: Path = typer.Option(
        Path("runs/demo-qwen3vl"), help="checkpoint folder the best model is written to"
    ),
    steps: int = typer.Option(6000),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(True),
    family: str = typer.Option("qwen3_vl", help="qwen3_vl (deepstack) or qwen3_5 (Gated DeltaNet hybrid); the "
                               "scenes task trains Qwen2.5-VL"),
    batch_size: int = typer.Option(16),
    threads: int = typer.Option(1),
    init_from: Path = typer.Option(None, help="checkpoint folder to copy matching weights from"),
    task: str = typer.Option("demo", help="demo (the grid task, 64 tokens per image) or scenes (demo-scenes: 160-400 "
                             "tokens per image, a 12-layer Qwen2.5-VL; about 4,500 steps, 3-4 hours on 2 cores)"),
    lr: float = typer.Option(2e-3, help="peak learning rate"),
    work: Path | None = typer.Option(None, help="folder for train_state.pt and train_log.jsonl (default: "
                                     "runs/train-<out's name>)"),
    eval_every: int = typer.Option(300, help="steps between validations"),
    aux_weight: float = typer.Option(0.5, help="weight of the per-cell auxiliary loss (0: off)"),
    attention_weight: float = typer.Option(1.0, help="weight of the attention-teacher loss (0: off)"),
    config: str = typer.Option("{}", help='JSON of the model config\'s keyword arguments, e.g. {"hidden": 192}'),
):
    """Train a tiny demo model from scratch on the demo task (seeded, resumable): --steps optimizer steps of
    --batch-size sequences, validated every --eval-every (the shipped demo model took 7200); then use it with
    --model OUT."""
    from trimvlm.demo.train import train_demo as _train

    if task not in ("demo", "scenes"):
        raise InputError(f"unknown demo task {task!r}; allowed: demo, scenes")
    try:
        extra = json.loads(config)
    except json.JSONDecodeError as e:
        raise InputError(f"--config must be a JSON object of model config arguments: {e}") from None
    if not isinstance(extra, dict):
        raise InputError(f"--config must be a JSON object of model config arguments, got {config!r}")
    kw: dict = {"model_kwargs": {"family": family, **extra}}
    if task == "scenes":
        from trimvlm.demo.scenes_train import SCENES_SPEC

        kw = {"model_kwargs": extra, "spec": SCENES_SPEC}
    _train(out_dir=str(out), steps=steps, seed=seed, resume=resume, batch_size=batch_size, threads=threads,
           init_from=init_from, lr=lr, work_dir=work, eval_every=eval_every, aux_weight=aux_weight,
           attention_weight=attention_weight, **kw)  # fmt: skip
    console.print(f'wrote {out}; use it: trimvlm generate --model {out} --image scene.png --prompt "how many blue ?"')


@command(rich_help_panel=USE)
def score(
    model: str = MODEL,
    image: list[Path] = typer.Option([], help="image file (repeat for several images)"),
    question: str = typer.Option(..., help="the question the candidates answer"),
    candidate: list[str] = typer.Option([], help="a candidate answer (repeat for each)"),
    readout: str = typer.Option("loglik", help="loglik | head"),
    executor: str = typer.Option("auto", help="auto | independent | batched | segments | tree"),
    recipe: str = typer.Option("", help="e.g. depth=ranking:file=rank.json:budget=2:scope=candidates"),
    binary: bool = typer.Option(False, help="one candidate statement, answered as P(true) (head readout)"),
    json_out: Path | None = JSON_OUT,
    load_kw: dict = LOAD_KW,
    wide: bool = WIDE,
):
    """Score candidate answers for one image + question (the prefix is encoded once)."""
    import trimvlm

    vlm = trimvlm.load(model, **load_kw)
    _warn_unknown(vlm, question)
    res = vlm.score(
        [str(p) for p in image], question, list(candidate), readout=readout, executor=executor,
        recipe=recipe or None, binary=binary,
    )  # fmt: skip
    _print_scores(res)
    _write_json(json_out, res.as_dict())


SCORE_COLUMNS = ["", "candidate", Col("logit", right=True, wide=True), Col("prob", right=True),
                 Col("loglik sum", right=True), Col("mean", right=True, wide=True), Col("tokens", right=True),
                 "matches greedy"]  # fmt: skip


def _print_scores(batch) -> None:
    for res in batch.results:
        table = Sheet(console, res.question, SCORE_COLUMNS)
        for k, c in enumerate(res.candidates):
            mark = "*" if k == res.chosen else ""
            table.row(
                mark, c.text, f"{c.logit:.4f}", f"{c.prob:.4f}", f"{c.loglik_sum:.4f}",
                f"{c.loglik_mean:.4f}", str(c.n_tokens), "yes" if c.is_greedy else "",
            )  # fmt: skip
        if res.abstain_logit is not None:
            table.row("*" if res.chosen < 0 else "", "(abstain)", f"{res.abstain_logit:.4f}",
                      f"{res.abstain_prob:.4f}", "", "", "", "")  # fmt: skip
        console.print(table)
        if res.binary_prob is not None:
            console.print(f"P(true) = {res.binary_prob:.4f}")
        console.print(f"chosen: {res.chosen_text if res.chosen >= 0 else '(abstain)'}")
        console.print("[dim]matches greedy: greedy decoding would produce this candidate (each of its tokens is the model's top choice)[/]")
    c = batch.costs
    console.print(
        f"[dim]{batch.executor} executor, {batch.tokens['executed']} of {batch.tokens['logical']} candidate "
        f"tokens executed; prefill {c.prefill_flops / 1e9:.4f} GFLOP, candidates "
        f"{c.flops.get('branch', 0) / 1e9:.4f} GFLOP, method {c.flops.get('method', 0) / 1e9:.6f} GFLOP, "
        f"{sum(c.seconds.values()) * 1e3:.0f} ms[/]"
    )


@command("train-head", rich_help_panel=TRAIN)
def train_head(
    model: str = MODEL,
    out: Path | None = typer.Option(None, help="folder to write the head to (default: the checkpoint's)"),
    overwrite: bool = OVERWRITE,
    steps: int = typer.Option(2000, help="optimizer steps over the cached features"),
    items: int = typer.Option(1200, help="training questions drawn from the demo task's train split"),
    task: str | None = typer.Option(None, help="demo or scenes (default: the checkpoint's own task)"),
    seed: int = typer.Option(0),
    threads: int = typer.Option(1, help="torch threads (the same seed and threads give the same weights)"),
    load_kw: dict = LOAD_KW,
):
    """Train the decision head on a demo task's candidate questions (backbone frozen, seeded)."""
    from trimvlm.cli_train import train_head_command

    train_head_command(
        model=model, out=out, steps=steps, items=items, seed=seed, console=console, threads=threads,
        load_kw=load_kw, overwrite=overwrite, task=task,
    )


@command(rich_help_panel=MEASURE)
def tune(
    model: str = MODEL,
    task: str | None = TASK("a registered task with a validation split (searched) and a test split"),
    budget: list[str] = typer.Option(
        [], help="AXIS=RATIO, repeat: total_flops | prefill_flops | kv_bytes | latency (one point per value, "
        "the product over axes)",
    ),
    data: str | None = typer.Option(None, help="a benchmark's local copy (its val and test splits)"),
    space: Path | None = typer.Option(None, help="search space YAML (default: the shipped trimvlm/tune/space.yaml)"),
    min_retention: float | None = typer.Option(None, help="flag budgets whose best keeps less of the accuracy"),
    n_val: int = typer.Option(192, help="validation items searched on"),
    n_test: int = typer.Option(600, help="test items the frontier is reported on"),
    seed: int = typer.Option(0),
    batch_size: int = typer.Option(48),
    threads: int | None = typer.Option(None, help="torch threads (default: torch's)"),
    out: Path = typer.Option(Path("runs/tune"), help="folder: tune.json, best*.yaml, recipes/, frontier.md/png"),
    ray: str | None = RAY("run the search's evaluations sharded"),
    workers: int | None = WORKERS(" for the whole search"),
    load_kw: dict = LOAD_KW,
    wide: bool = WIDE,
):
    """Find the best recipe for each cost budget on the task's validation split (resumable: run it again to
    continue), then report the frontier on the test split. Use a result with --recipe OUT/best-BUDGET.yaml or
    recipe tuned=OUT:budget=RATIO."""
    from trimvlm.cli_tune import tune_command

    tune_command(model, _task(model, task), budget, data=data, space=space, out=out, min_retention=min_retention,
                 n_val=n_val, n_test=n_test, seed=seed, batch_size=batch_size, threads=threads,
                 console=console, load_kw=load_kw, ray=ray, workers=workers)  # fmt: skip


@command("train-router", rich_help_panel=TRAIN)
def train_router(
    model: str = MODEL,
    out: Path = typer.Option(Path("runs/router"), help="folder the router checkpoint is written to"),
    overwrite: bool = OVERWRITE,
    task: str | None = TASK("unlabeled inputs: the demo task's val split"),
    n: int = typer.Option(32, help="training inputs"),
    token_keep: float = typer.Option(0.25, help="fraction of each image's visual tokens kept"),
    layers_skip: int = typer.Option(2, help="candidate layers (the last half) skipped per input"),
    epochs: int = typer.Option(3),
    seed: int = typer.Option(0),
    layer: int = typer.Option(0, help="decoder layer the router runs before and drops tokens at (0: the input)"),
    lr: float = typer.Option(1e-3, help="Adam learning rate"),
    beta: float = typer.Option(0.1, help="DPO beta"),
    resume: bool = typer.Option(True, help="continue from the checkpoint in --out"),
    keeps: str | None = typer.Option(
        None, help="router v2: token keeps of the layouts, e.g. 0.25,0.4,0.55,0.7,0.85,1 (then router=OUT:budget=B)"
    ),
    max_skip: int | None = typer.Option(None, help="router v2: most candidate layers a layout skips"),
    width: int = typer.Option(64, help="the router's width (its FLOPs are method FLOPs: narrower is cheaper)"),
    work: Path | None = typer.Option(
        None, help="folder each input's measured layouts are written to as measured; run again to resume"
    ),
    near: float | None = typer.Option(
        None, help="router v2: noise-perturbed token sets run only layouts within this total-FLOP ratio of a --budgets"
    ),
    budgets: str | None = typer.Option(None, help="router v2: total-FLOP budgets, e.g. 0.75,0.6,0.45 (with --near)"),
    cells: int | None = typer.Option(None, help="with --near: at most this many (keep, layer set) cells per input"),
    load_kw: dict = LOAD_KW,
):
    """Train the PAR meta-router self-supervised with DPO (layouts ranked by KL to the unpruned model): --n
    inputs x --epochs (384 x 30 take about 4 minutes on one CPU thread with the demo model). --epochs 0 with
    --work only measures the inputs' layouts."""
    import trimvlm
    from trimvlm.evals.tasks import calibration_items
    from trimvlm.loading import refuse_shipped
    from trimvlm.progress import steps
    from trimvlm.training.router import train_router as train

    keeps, budgets = (None if v is None else _numbers(f"--{k}", v) for k, v in (("keeps", keeps), ("budgets", budgets)))
    refuse_shipped(out, overwrite)
    vlm = trimvlm.load(model, **load_kw)
    records = calibration_items(_task(model, task), n, seed)
    with steps("train-router", len(records) + epochs, console,
               phase=f"layouts of {len(records)} inputs, then {epochs} DPO epochs") as bar:  # fmt: skip
        log = train(vlm, records, token_keep=token_keep, layers_skip=layers_skip, epochs=epochs, seed=seed, out=out,
                    resume=resume, on_step=bar.advance, layer=layer, lr=lr, beta=beta, keeps=keeps, max_skip=max_skip,
                    width=width, work=work, near=near, budgets=budgets, cells=cells)  # fmt: skip
    for e in log["epochs"]:
        console.print(f"epoch {e['epoch']}: DPO loss {e['dpo_loss']:.4f}")
    if not epochs:
        console.print(f"measured the layouts of {len(records)} inputs into {work}; no epoch trained")
        return
    use = (f"router={out}:budget=0.75 (after `trimvlm calibrate-router {out} --model {model}`)" if keeps
           else f"router={out}:token_keep={token_keep}:layers_skip={layers_skip}")  # fmt: skip
    console.print(f"wrote {out}; use it as the recipe {use}")


@command("refit-router", rich_help_panel=TRAIN)
def refit_router(
    router: str = ROUTER,
    model: str = MODEL,
    out: Path | None = typer.Option(None, help="folder to write the refit router to (default: in place)"),
    overwrite: bool = OVERWRITE,
    task: str | None = TASK("unlabeled inputs: the task's first val inputs"),
    n: int = typer.Option(512, help="inputs whose layouts are measured"),
    select: str = typer.Option("router", help="whose tokens the layouts keep: router or a token method NAME@LAYER"),
    epochs: int = typer.Option(40),
    head_only: bool = typer.Option(True, help="train the layer head alone (the token scores stay as they are)"),
    load_kw: dict = LOAD_KW,
):
    """Train a v2 router's layer scores (DPO) on layouts run with the tokens a recipe executes (each input's
    layouts as one layout trie)."""
    from trimvlm.cli_train import refit_router_command

    refit_router_command(router, model=model, task=_task(model, task), n=n, select=select, epochs=epochs, out=out,
                         console=console, load_kw=load_kw, overwrite=overwrite,
                         head_only=head_only)  # fmt: skip


@command("calibrate-router", rich_help_panel=TRAIN)
def calibrate_router(
    router: str = ROUTER,
    model: str = MODEL,
    overwrite: bool = OVERWRITE,
    task: str | None = TASK("unlabeled inputs: the task's val split after the training ones"),
    n: int = typer.Option(64, help="held-out calibration inputs"),
    skip: int | None = typer.Option(None, help="val inputs to skip (default: the router's training inputs)"),
    select: str = typer.Option("router", help="selectors, comma-separated: router and/or token methods NAME@LAYER"),
    load_kw: dict = LOAD_KW,
):
    """Calibrate a v2 router's budgets on held-out inputs with the tokens each selector executes (one layout trie
    per input and selector: --n 64 with 4 selectors took about 4 minutes on one loaded CPU thread with
    demo-scenes)."""
    from trimvlm.cli_train import calibrate_router_command

    calibrate_router_command(router, model=model, task=_task(model, task), n=n, skip=skip,
                             select=tuple(x.strip() for x in select.split(",") if x.strip()), console=console,
                             load_kw=load_kw, overwrite=overwrite)  # fmt: skip


@command("pick-router", rich_help_panel=TRAIN)
def pick_router(
    router: str = ROUTER,
    model: str = MODEL,
    overwrite: bool = OVERWRITE,
    budgets: str = typer.Option(..., help="total-FLOP budgets, comma-separated, e.g. 0.85,0.75,0.65"),
    select: str = typer.Option("", help="a token method NAME@LAYER tried as select= beside the router's own "
                               "scores (the tuned recipe's, e.g. dart@2), or one per budget, comma-separated"),
    task: str | None = TASK("validation items: the task's val split after the router's inputs"),
    n_val: int = typer.Option(96, help="validation items per variant"),
    load_kw: dict = LOAD_KW,
):
    """Choose router v2's variant (select, price) per budget on validation items and record it, so that the
    plain `router=M:budget=B` runs it. About 1 minute per budget on the demo models (7 variants x 96 items)."""
    from trimvlm.cli_train import v2_router
    from trimvlm.evals.tasks import check_positive
    from trimvlm.training.variants import pick_variant, record_variants

    values = _numbers("--budgets", budgets, "total-FLOP ratios in (0, 1), comma-separated;", within=(0, 1))
    check_positive("--n-val", n_val, "a positive number of items")
    methods = [m.strip() or None for m in select.split(",")] if select else [None]
    if len(methods) not in (1, len(values)):
        raise InputError(f"--select names one token method or one per budget ({len(values)}), got {select!r}")
    task = _task(model, task)
    folder, vlm, _ = v2_router(router, model, load_kw, "given variants", overwrite)
    picked = []
    for b, method in zip(values, methods * len(values) if len(methods) == 1 else methods, strict=True):
        picked.append(v := pick_variant(vlm, str(folder), b, method, task=task, n_val=n_val, name=router))
        console.print(f"budget {b}: select={v['select']} price={v['price']} "
                      f"({100 * v['val_accuracy']:.1f}% on {v['val_items']} val items)")  # fmt: skip
    record_variants(folder, picked)
    console.print(f"recorded in {folder}; `router={router}:budget=B` now runs the variant of the nearest budget")


@command("pick-routes", rich_help_panel=TRAIN)
def pick_routes(
    router: str = ROUTER,
    model: str = MODEL,
    overwrite: bool = OVERWRITE,
    budget: float = typer.Option(..., help="the budget of a variant pick-router recorded"),
    routes: str = typer.Option(..., help="two or more token methods NAME@LAYER, comma-separated, e.g. "
                               "density@0,density@2: each input runs one of them"),
    task: str | None = TASK("validation items: the task's val split after the router's inputs"),
    n_val: int = typer.Option(600, help="validation items to fit the switch on, and as many again to check it"),
    load_kw: dict = LOAD_KW,
):
    """Fit router v2's switch among routes at one budget (training/routes.py) and record the routed variant
    where it answers more validation items than the recorded one, so that the plain `router=M:budget=B` runs
    it."""
    from trimvlm.cli_train import v2_router
    from trimvlm.evals.tasks import check_positive
    from trimvlm.training.routes import pick_routes as fit_routes

    check_positive("--n-val", n_val, "a positive number of items")
    selects = [x.strip() for x in routes.split(",") if x.strip()]
    folder, vlm, _ = v2_router(router, model, load_kw, "given routes", overwrite)
    got = fit_routes(vlm, str(folder), float(budget), selects, _task(model, task), n_val)
    verdict = "recorded" if got["recorded"] else "not recorded (the recorded variant stays)"
    console.print(f"budget {budget}: routes {', '.join(selects)}: {100 * got['routed_accuracy']:.1f}% against "
                  f"{100 * got['single_accuracy']:.1f}% on {got['items']} val items: {verdict}")  # fmt: skip


@command(rich_help_panel=TRAIN)
def calibrate(
    model: str = MODEL,
    task: str | None = TASK("task whose candidate questions calibrate (labels are not used)"),
    n: int = typer.Option(32, help="calibration inputs"),
    readout: str = typer.Option("auto", help="logits the sensitivity is measured on: auto | loglik | head"),
    seed: int = typer.Option(0),
    json_out: Path = typer.Option(Path("rank.json"), "--json", help="where the ranking is written"),
    method: str = typer.Option(
        "candidates",
        help="candidates (FastJEV's J_l, candidate branches) | block-influence (ShortGPT BI_l) | sensitivity "
        "(J_l on next-token logits) | greedy-kl | fitprune (attention statistics for tokens=fitprune:file=...)",
    ),
    load_kw: dict = LOAD_KW,
):
    """Decision-guided layer ranking (FastJEV's J_l) for `depth=ranking:file=...:scope=candidates`, or a depth
    ranker's order for `depth=ranking:file=...`: --n inputs, one pass per layer and batch of them."""
    from trimvlm.cli_calibrate import calibrate_command

    calibrate_command(method, model=model, task=_task(model, task), n=n, readout=readout, seed=seed, json_out=json_out,
                      console=console, load_kw=load_kw)  # fmt: skip


@command(rich_help_panel=USE)
def decide(
    model: str = MODEL,
    request: Path = typer.Option(..., help="JSON file: one System One request, or a list of them"),
    recipe: str = typer.Option("", help="e.g. tokens=density:keep=0.25:layer=1 (kv= does not apply)"),
    decision_config: Path | None = typer.Option(None, help="decision.json (or its folder); default: the model's"),
    json_out: Path | None = JSON_OUT,
    load_kw: dict = LOAD_KW,
    wide: bool = WIDE,
):
    """Answer System One decision requests (noul / choice / score questions about a state and its images)."""
    import trimvlm
    from trimvlm.cli_decide import print_decisions, read_requests

    requests = read_requests(request)
    result = trimvlm.load(model, **load_kw).decide(requests, recipe=recipe or None, decision_config=decision_config,
                                                   return_costs=True)  # fmt: skip
    print_decisions(result, console, requests)
    one = not isinstance(requests, list)
    _write_json(json_out, {"answers": result.answers[0] if one else result.answers,
                           "usage": result.usage[0].usage() if one else [u.usage() for u in result.usage],
                           "recipe": result.recipe, "costs": result.costs.as_dict()})  # fmt: skip


@command(rich_help_panel=USE)
def serve(
    model: str = MODEL,
    recipe: str = typer.Option("", help="the default recipe (a request's `recipe` field overrides it)"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    max_batch: int = typer.Option(32, help="requests per batch at most (1: one request at a time)"),
    max_wait_ms: float = typer.Option(10.0, help="how long a request waits for others to batch with"),
    max_new_tokens: int = typer.Option(256, help="the most new tokens a chat completion may ask for (max_tokens)"),
    max_images: int = typer.Option(8, help="images per request at most"),
    max_questions: int = typer.Option(64, help="questions per System One request at most"),
    max_body_mb: int = typer.Option(16, help="request body size limit, MiB"),
    decision_config: Path | None = typer.Option(None, help="decision.json (or its folder); default: the model's"),
    max_prefill_tokens: int = typer.Option(
        4096, help="prompt tokens prefilled between two decode steps (a longer prompt is prefilled in chunks of this)"
    ),
    threads: int = typer.Option(1, help="torch threads (0: torch's default, all cores; docs/serving.md)"),
    vision_cache_mb: float = typer.Option(256, help="vision-feature cache bound, MiB (0: off; docs/serving.md)"),
    prefix_cache_mb: float = typer.Option(512, help="System One prefix cache bound, MiB (0: off)"),
    request_cache_mb: float = typer.Option(256, help="prepared System One requests cache bound, MiB (0: off)"),
    recipe_dir: Path | None = typer.Option(
        None, help="a folder of `trimvlm tune` outputs: clients may name them (recipe tuned=NAME:budget=X)"
    ),
    api_key: str | None = typer.Option(
        None, envvar="TRIMVLM_API_KEY", show_default=False,
        help="requests to /v1/... need 'Authorization: Bearer KEY' (401 else); /health stays open",
    ),  # fmt: skip
    key_metrics: bool = typer.Option(False, help="/metrics needs the API key too"),
    tuned: Path | None = typer.Option(
        None, help="a `trimvlm tune` folder: requests naming no recipe take its frontier's by the load (--slo-ttft-ms)"
    ),
    slo_ttft_ms: float | None = typer.Option(
        None, help="the time-to-first-token objective: past it, new requests take the next cheaper tuned recipe"
    ),
    log_level: str = typer.Option("info", help="uvicorn's log level"),
    access_log: bool = typer.Option(True, help="one JSON line per request on stderr"),
    replicas: int = typer.Option(1, help="model replicas, a Ray Serve deployment behind one route (needs --ray)"),
    api_workers: int = typer.Option(
        0, help="API processes (HTTP, JSON, images, tokenizing) beside the engine process (0: one process)"
    ),
    ray: str | None = typer.Option(None, "--ray", help="run the replicas on Ray: local, auto or HOST:PORT"),
    load_kw: dict = LOAD_KW,
):
    """HTTP server: System One decisions (/v1/systemone) and OpenAI-style chat completions (continuous batching,
    streaming), GET /metrics."""
    from trimvlm.serve import require

    require()
    from trimvlm.serve.limits import MiB, ServerLimits
    from trimvlm.serve.main import serve as run_server

    limits = ServerLimits(max_body_bytes=max_body_mb * MiB, max_images=max_images, max_questions=max_questions,
                          max_tokens=max_new_tokens, default_max_tokens=min(32, max_new_tokens),
                          max_prefill_tokens=max_prefill_tokens)  # fmt: skip
    run_server(model, recipe=recipe, host=host, port=port, max_batch=max_batch, max_wait_ms=max_wait_ms,
               limits=limits, decision_config=decision_config, threads=threads,
               vision_cache_mb=vision_cache_mb, prefix_cache_mb=prefix_cache_mb, request_cache_mb=request_cache_mb,
               load_kw=load_kw, log_level=log_level, access_log=access_log,
               replicas=replicas, ray=ray, recipe_dir=recipe_dir, api_key=api_key,
               key_metrics=key_metrics, tuned=tuned, slo_ttft_ms=slo_ttft_ms, api_workers=api_workers)  # fmt: skip


if __name__ == "__main__":
    app()
