"""Evaluation harness: metrics on hand-made cases, tasks and the JSONL loader, the interleaved run loop,
reports, the `demo` / `eval` main jobs end to end on a tiny random model, and bad-input errors."""

import json
from collections import defaultdict

import pytest
import torch

from trimvlm import Recipe
from trimvlm.errors import CheckpointError, InputError, RecipeError, TrimVLMError
from trimvlm.evals import metrics as M
from trimvlm.evals.plot import Point
from trimvlm.evals.report import pareto_front, plot_pareto, print_report, result_dict, write_json
from trimvlm.evals.run import normalize_recipes, run_eval
from trimvlm.evals.tasks import Record, Task, demo_task, get_task, load_jsonl
from trimvlm.runtime.meter import Costs
from trimvlm.testing import WORDS, random_image

# --------------------------------------------------------------------------------------------- metrics


def test_normalize_and_exact_match():
    assert M.normalize_answer("  The Red, CIRCLE! ") == "red circle"
    assert M.normalize_answer("an apple a day") == "apple day"
    assert M.exact_match("A red circle.", "red circle") == 1.0
    assert M.exact_match("red square", ["blue square", "Red Square"]) == 1.0
    assert M.exact_match("red", "red circle") == 0.0
    assert M.exact_strict("7  A 3", "7 A 3") == 1.0
    assert M.exact_strict("7 3", "7 A 3") == 0.0  # where plain exact match would wrongly agree
    assert M.exact_match("7 3", "7 A 3") == 1.0


def test_anls_hand_made():
    assert M.anls("hello", "hello") == 1.0
    assert M.anls("Hello ", ["hello"]) == 1.0  # case and surrounding space ignored
    assert M.anls("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert M.anls("abc", "xyz") == 0.0
    assert M.anls("ab", "abcd") == 0.0  # NL = 0.5 is not below the threshold
    assert M.anls("abc", "abcd") == pytest.approx(0.75)
    assert M.anls("kitten", ["sitting", "kitten!"]) == pytest.approx(1 - 1 / 7)  # max over references
    assert M.levenshtein("kitten", "sitting") == 3
    assert M.anls("", "") == 1.0


def test_option_index_and_accuracy():
    opts = ["red circle", "blue square", "green triangle"]
    for pred in ("B", "(B)", "B.", "B) blue square", " b ", "blue square", "The blue square"):
        assert M.option_index(pred, opts) == 1, pred
    assert M.option_index("a red circle", opts) == 0  # the article "a", matched by the option's text
    assert M.option_index("D", opts) is None
    assert M.option_index("purple", opts) is None
    metric = M.get_metric("option")
    assert metric.score("B", ["B"], opts) == 1.0
    assert metric.score("blue square", ["B"], opts) == 1.0
    assert metric.score("C", ["blue square"], opts) == 0.0
    with pytest.raises(InputError, match="names none of the options"):
        metric.score("A", ["purple"], opts)


def test_yes_no_accuracy_and_f1():
    assert M.yes_no("Yes, there is.") == "yes"
    assert M.yes_no("no") == "no"
    assert M.yes_no("there is not") == "no"
    assert M.yes_no("red") is None
    preds = ["yes", "yes", "no", "no", "maybe"]
    golds = ["yes", "no", "yes", "no", "yes"]
    s = M.yes_no_f1([M.yes_no(p) for p in preds], golds)
    # tp = 1, fp = 1, fn = 2 (one "no", one unparsable), correct = 2 of 5
    assert s["accuracy"] == pytest.approx(2 / 5)
    assert s["precision"] == pytest.approx(1 / 2)
    assert s["recall"] == pytest.approx(1 / 3)
    assert s["f1"] == pytest.approx(2 * 0.5 * (1 / 3) / (0.5 + 1 / 3))
    assert s["predicted_yes_ratio"] == pytest.approx(2 / 5)
    assert M.get_metric("yesno").score("Yes.", ["yes"]) == 1.0


def test_mismatch_pct():
    assert M.mismatch_pct(["a", "b"], ["a", "b"]) == 0.0
    assert M.mismatch_pct(["red", "blue", "green", "x"], ["Red.", "blue", "grey", "y"], "exact") == 50.0
    opts = [["x", "y"]] * 3
    # "B", "(B)" and "y" all name option B: no mismatch there
    assert M.mismatch_pct(["B", "(B)", "A"], ["y", "B", "B"], "option", opts) == pytest.approx(100 / 3)
    assert M.mismatch_pct(["Yes.", "no"], ["yes", "yes"], "yesno") == 50.0
    assert M.mismatch_pct([], []) == 0.0
    with pytest.raises(InputError, match="2 predictions for 1 baseline"):
        M.mismatch_pct(["a", "b"], ["a"])


def test_unknown_metric_error():
    with pytest.raises(
        TrimVLMError, match=r"unknown metric 'bleu'; known metrics: anls, exact, exact_strict"
    ):
        M.get_metric("bleu")
    with pytest.raises(InputError, match="unknown metric 'bleu'"):
        Record("q", [], "what", ["x"], metric="bleu")


# --------------------------------------------------------------------------------------------- tasks


def test_demo_task_records():
    t = demo_task(limit=14, seed=0)
    assert len(t.records) == 14
    kinds = t.kinds()
    assert list(kinds) == ["exist", "mc", "color", "count", "list", "read"]
    assert kinds["exist"] == {"probe": "prefill", "metric": "yesno", "n": 3}
    assert kinds["read"]["metric"] == "exact_strict" and kinds["list"]["probe"] == "full"
    mc = next(r for r in t.records if r.kind == "mc")
    assert mc.prompt_text() == mc.question and len(mc.options) == 4 and mc.answers[0] in "ABCD"
    assert M.get_metric("option").score(mc.answers[0], mc.answers, mc.options) == 1.0
    assert (t.new_tokens("prefill", "mc"), t.new_tokens("full", "list"), t.new_tokens("full", "read")) == (
        1,
        8,
        5,
    )
    assert [r.id for r in demo_task(limit=14, seed=0).records] == [r.id for r in t.records]
    assert [r.answers for r in demo_task(limit=14, seed=1).records] != [r.answers for r in t.records]


def _write_tiny_task(folder, n=6):
    """A JSONL task whose words the tiny test tokenizer knows (trimvlm.testing.WORDS)."""
    assert {"red", "blue", "yes", "no", "circle", "square", "read", "text"} <= set(WORDS)
    (folder / "img").mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        random_image(i, (64, 64)).save(folder / "img" / f"{i}.png")
        kind = ("option", "yesno", "exact")[i % 3]
        rec = {"id": f"t{i}", "image": f"img/{i}.png", "question": "what is the colour of the circle"}
        if kind == "option":
            rec.update(options=["red", "blue", "green"], answer="B", prompt="which colour red blue green")
        elif kind == "yesno":
            rec.update(question="is there a red square", metric="yesno", answer="yes" if i % 2 else "no")
        else:
            rec.update(question="read the text", answers=["one two", "one"], kind="read", metric="anls")
        lines.append(json.dumps(rec))
    path = folder / "tiny.jsonl"
    path.write_text("# a tiny task\n" + "\n".join(lines) + "\n\n")
    return path


def test_jsonl_loader(tmp_path):
    path = _write_tiny_task(tmp_path)
    t = get_task(str(path))
    assert t.name == "tiny" and len(t.records) == 6
    r0, r1, r2 = t.records[:3]
    assert (r0.metric, r0.probe, r0.kind, r0.answers) == ("option", "prefill", "option", ["B"])
    assert r0.prompt_text() == "which colour red blue green"
    assert (r1.metric, r1.probe) == ("yesno", "prefill")
    assert r1.prompt_text().startswith("is there a red square\n")
    assert (r2.metric, r2.probe, r2.kind, r2.answers) == ("anls", "full", "read", ["one two", "one"])
    assert r2.images == [tmp_path / "img" / "2.png"]
    assert len(get_task(f"jsonl:{path}", limit=2).records) == 2
    # options without a prompt: shown to the model as lettered lines plus the usual instruction
    r = Record("o", [], "which one", ["b"], options=["x", "y"], probe="prefill", metric="option")
    assert r.prompt_text().split("\n")[:3] == ["which one", "A. x", "B. y"]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "q", "answer": "x", "metric": "bleu"}', r"tiny.jsonl:1: unknown metric 'bleu'; known"),
        (
            '{"question": "q", "answer": "x", "probe": "middle"}',
            r"unknown probe kind 'middle'; allowed: prefill, full",
        ),
        ('{"question": "q"}', r"tiny.jsonl:1: a reference is required"),
        ('{"answer": "x"}', r"'question' is required"),
        ('{"question": "q", "answer": "x", "colour": 1}', r"unknown field\(s\) \['colour'\]"),
        ('{"question": "q", "answer": "x", "image": "nope.png"}', r"image file not found: .*nope.png"),
        ('{"question": "q", "answer": "D", "options": ["a", "b"]}', r"names none of the options"),
        ('{"question": "q", "answer": "x", "metric": "option"}', r"metric 'option' needs 'options'"),
        ('{"question": "q", "answer": "x",', r"tiny.jsonl:1: not valid JSON"),
    ],
)
def test_jsonl_bad_records(tmp_path, line, message):
    path = tmp_path / "tiny.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=message):
        load_jsonl(path)


def test_unknown_task_and_bad_limit(tmp_path):
    with pytest.raises(TrimVLMError, match=r"unknown task 'vqa2'; known tasks: demo, demo-candidates, demo-decisions, scenes, scenes-candidates, or a JSONL file"):
        get_task("vqa2")
    with pytest.raises(InputError, match="task file not found"):
        get_task(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n# nothing\n")
    with pytest.raises(InputError, match="holds no records"):
        get_task(str(tmp_path / "empty.jsonl"))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InputError, match=r"limit must be a positive number of items"):
            get_task("demo", limit=bad)


# --------------------------------------------------------------------------------------------- recipes


def test_normalize_recipes_baseline_first():
    rs = normalize_recipes([Recipe(name="copy")])
    assert [r.label() for r in rs] == ["baseline", "copy"]
    rs = normalize_recipes([Recipe(name="copy"), "", Recipe(name="x")])  # "" is the unnamed empty recipe
    assert [r.label() for r in rs] == ["baseline", "copy", "x"]
    rs = normalize_recipes([Recipe(name="copy"), "baseline"])
    assert [r.label() for r in rs] == ["baseline", "copy"]
    assert [r.label() for r in normalize_recipes(None)] == ["baseline"]
    with pytest.raises(RecipeError, match=r"duplicate recipe label\(s\) \['copy'\]"):
        normalize_recipes([Recipe(name="copy"), Recipe(name="copy")])
    with pytest.raises(RecipeError, match="unknown tokens method 'nosuch'"):
        normalize_recipes(["tokens=nosuch:keep=0.5"])


# --------------------------------------------------------------------------------------------- run loop


class FakeVLM:
    """Answers from a table keyed by (recipe, question); costs scale with the recipe's `scale`."""

    def __init__(self, answers, scale):
        self.answers, self.scale, self.calls = answers, scale, []

    def generate(self, images, prompts, *, recipe=None, max_new_tokens=32, seed=0):
        label = recipe.label()
        self.calls.append((label, tuple(prompts), max_new_tokens))
        c = Costs()
        s = self.scale[label]
        n = len(prompts)
        c.flops["vision"] += 10 * n
        c.flops["prefill"] += int(90 * n * s)
        if max_new_tokens > 1:
            c.flops["decode"] += 50 * n
        c.kv_bytes = int(1000 * n * s)
        c.seconds["prefill"] = 0.01

        class R:
            texts = [self.answers[label].get(p, "") for p in prompts]
            costs = c

        return R()


def _fake_task():
    recs = [
        Record("a", [], "q1", ["yes"], probe="prefill", metric="yesno", kind="exist"),
        Record("b", [], "q2", ["no"], probe="prefill", metric="yesno", kind="exist"),
        Record("c", [], "q3", ["B"], options=["x", "y"], probe="prefill", metric="option", kind="mc"),
        Record("d", [], "q4", ["one two"], probe="full", metric="exact", kind="list"),
        Record("e", [], "q5", ["one"], probe="full", metric="exact", kind="list"),
    ]
    for r in recs:
        r.prompt = r.question
    return Task("fake", recs, max_new_tokens=8)


def test_run_loop_numbers_and_interleaving():
    base = {"q1": "yes", "q2": "yes", "q3": "B", "q4": "one two", "q5": "two"}
    half = {"q1": "yes", "q2": "no", "q3": "(A)", "q4": "One two.", "q5": "one"}
    vlm = FakeVLM({"baseline": base, "half": half}, {"baseline": 1.0, "half": 0.5})
    res = run_eval(vlm, _fake_task(), [Recipe(name="half")], batch_size=1, warmup=False, progress=False)
    assert res.labels == ["baseline", "half"]
    # interleaved: both recipes on every batch, the first recipe rotating batch by batch
    firsts = [vlm.calls[2 * b][0] for b in range(5)]
    assert firsts == ["baseline", "half", "baseline", "half", "baseline"]
    assert [c[1] for c in vlm.calls[0::2]] == [c[1] for c in vlm.calls[1::2]]
    assert {c[2] for c in vlm.calls if c[1][0] in ("q1", "q2", "q3")} == {1}  # prefill probes: 1 token
    assert {c[2] for c in vlm.calls if c[1][0] in ("q4", "q5")} == {8}

    b_exist, h_exist = res.row("baseline", "exist"), res.row("half", "exist")
    assert b_exist["accuracy"] == 0.5 and h_exist["accuracy"] == 1.0
    assert b_exist["f1"] == pytest.approx(2 / 3) and h_exist["f1"] == 1.0
    assert h_exist["mismatch_pct"] == 50.0 and b_exist["mismatch_pct"] == 0.0
    assert res.row("half", "mc")["accuracy"] == 0.0 and res.row("half", "mc")["mismatch_pct"] == 100.0
    h_list = res.row("half", "list")
    assert h_list["accuracy"] == 1.0 and h_list["mismatch_pct"] == 50.0  # "One two." == "one two"
    assert res.row("baseline", "list")["accuracy"] == 0.5
    assert res.row("half", "all")["accuracy"] == pytest.approx(4 / 5)
    assert res.row("half", "all")["mismatch_pct"] == pytest.approx(100 * 3 / 5)

    # costs: sums over the group's items, ratios to the baseline on the same items
    p = res.row("half", "prefill")
    assert p["costs"]["sum"]["prefill_flops"] == 3 * (10 + 45)
    assert p["ratio"]["prefill_flops"] == pytest.approx(55 / 100)
    assert p["ratio"]["kv_bytes"] == pytest.approx(0.5)
    assert p["ratio"]["decode_flops"] is None  # prefill probes never decode: 0 / 0
    f = res.row("half", "full")
    assert f["costs"]["per_item"]["decode_flops"] == 50 and f["ratio"]["decode_flops"] == 1.0
    assert res.row("baseline", "all")["ratio"]["total_flops"] == 1.0
    assert res.row("baseline", "all")["costs"]["batches"] == 5


def test_limit_and_batching_with_fake():
    vlm = FakeVLM({"baseline": {}}, {"baseline": 1.0})
    res = run_eval(vlm, _fake_task(), None, limit=4, batch_size=2, warmup=True, progress=False)
    assert len(res.task.records) == 4
    # warm-up (2 items, discarded), then exist x2 in one batch, mc, list: batches never mix kinds
    assert [c[1] for c in vlm.calls] == [("q1", "q2"), ("q1", "q2"), ("q3",), ("q4",)]
    with pytest.raises(InputError, match="batch_size must be a positive integer"):
        run_eval(vlm, _fake_task(), None, batch_size=0)


def test_pareto_front():
    xy = [(1.0, 90.0), (0.5, 85.0), (0.8, 80.0), (0.25, 60.0), (0.5, 70.0), (1.0, 95.0)]
    pts = [Point(str(k), x, y) for k, (x, y) in enumerate(xy)]
    assert pareto_front(pts) == [3, 1, 5]


# --------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_vlm(tiny_dir):
    import trimvlm

    return trimvlm.load(tiny_dir("qwen3_vl"))


def test_harness_end_to_end_tiny_model(tiny_vlm, tmp_path):
    task = load_jsonl(_write_tiny_task(tmp_path), max_new_tokens=3)
    res = run_eval(tiny_vlm, task, [Recipe(name="copy")], batch_size=2, seed=0, warmup=False, progress=False)
    assert res.labels == ["baseline", "copy"]
    assert res.predictions[0] == res.predictions[1]  # a baseline-equivalent recipe changes nothing
    for row in res.rows:
        if row["recipe"] == "copy":
            assert row["mismatch_pct"] == 0.0
            for key in ("prefill_flops", "total_flops", "kv_bytes"):
                assert row["ratio"][key] == 1.0, (row["group"], key)
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["costs"]["sum"]["prefill_flops"] > 0 and row["costs"]["sum"]["kv_bytes"] > 0
    assert res.row("baseline", "prefill")["costs"]["sum"]["decode_flops"] == 0  # one token: no decode step
    # the full items' decode FLOPs are what the model's meter counts for their batch, and there are some: a
    # decode step ran for every token after the first
    full = [r for r in task.records if r.probe == "full"]
    direct = tiny_vlm.generate([list(r.images) for r in full], [r.prompt_text() for r in full], max_new_tokens=3,
                               seed=0)  # fmt: skip
    decoded = res.row("baseline", "full")["costs"]["sum"]["decode_flops"]
    assert decoded == direct.costs.decode_flops
    assert (decoded > 0) == (max(len(t) for t in direct.tokens) > 1)
    assert {r["group"] for r in res.rows} == {"option", "yesno", "read", "prefill", "full", "all"}

    from rich.console import Console

    console = Console(record=True, width=160)
    print_report(res, console=console)
    text = console.export_text()
    assert "baseline" in text and "copy" in text and "mismatch % vs baseline" in text
    assert "cost / baseline" in text and "1.00x" in text

    out = write_json(res, tmp_path / "r" / "out.json")
    data = json.loads(out.read_text())
    assert set(data["versions"]) >= {"trimvlm", "torch", "transformers"}
    assert data["settings"]["seed"] == 0 and data["settings"]["batch_size"] == 2
    assert [r["label"] for r in data["recipes"]] == ["baseline", "copy"]
    assert len(data["items"]) == 6 and len(data["predictions"]["copy"]["outputs"]) == 6
    assert data == json.loads(json.dumps(result_dict(res) | {"versions": data["versions"]}))
    png = plot_pareto(res, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_command_end_to_end(tiny_dir, tmp_path):
    from rich.console import Console

    from trimvlm.cli_eval import eval_command

    task = _write_tiny_task(tmp_path, n=2)
    recipes = tmp_path / "r.yaml"
    recipes.write_text("- name: copy\n")
    data = eval_command(
        str(tiny_dir("qwen3_vl")),
        str(task),
        recipes,
        limit=2,
        json_out=tmp_path / "o.json",
        plot_out=tmp_path / "o.png",
        batch_size=2,
        seed=0,
        max_new_tokens=2,
        progress=False,
        console=Console(file=open(tmp_path / "log.txt", "w")),  # noqa: SIM115
        markdown_out=tmp_path / "o.md",
    )
    assert [r["label"] for r in data["recipes"]] == ["baseline", "copy"]
    assert (tmp_path / "o.json").exists() and (tmp_path / "o.png").exists()
    md = (tmp_path / "o.md").read_text().splitlines()
    assert md[0].startswith("| recipe |") and "mismatch %" in md[0] and len(md) == 4
    cells = [c.strip() for c in md[3].strip("|").split("|")]
    head = [c.strip() for c in md[0].strip("|").split("|")]
    row = dict(zip(head, cells, strict=True))
    assert cells[0] == "copy" and row["prefill FLOPs"] == row["total FLOPs"] == row["KV bytes"] == "1.00x"
    assert row["method share"] == "0.0%"  # an empty recipe does no method work
    by = defaultdict(dict)
    for row in data["results"]:
        by[row["recipe"]][row["group"]] = row
    assert by["copy"]["all"]["mismatch_pct"] == 0.0 and by["copy"]["all"]["ratio"]["total_flops"] == 1.0


# --------------------------------------------------------------------------------------------- bad input


def test_eval_command_bad_input(tiny_dir, tmp_path):
    from trimvlm.cli_eval import eval_command

    model = str(tiny_dir("qwen3_vl"))
    with pytest.raises(InputError, match="limit must be a positive number of items"):
        eval_command(model, "demo", limit=0)
    with pytest.raises(InputError, match="unknown task 'nosuch'"):
        eval_command("/no/such/model", "nosuch", limit=5)  # checked before any model loads
    bad = tmp_path / "bad.yaml"
    bad.write_text("tokens: [density\n")
    with pytest.raises(RecipeError, match=r"recipe file .*bad.yaml does not parse as YAML/JSON"):
        eval_command(model, "demo", bad, limit=5)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("- tokens: nosuch:keep=0.5\n")
    with pytest.raises(RecipeError, match="unknown tokens method 'nosuch'"):
        eval_command(model, "demo", unknown, limit=5)
    axis = tmp_path / "axis.yaml"
    axis.write_text("- {name: x, colour: red}\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key\(s\) \['colour'\]"):
        eval_command(model, "demo", axis, limit=5)
    with pytest.raises(RecipeError, match="recipe file not found"):
        eval_command(model, "demo", tmp_path / "missing.yaml", limit=5)
    (tmp_path / "m.jsonl").write_text('{"question": "q", "answer": "x", "metric": "bleu"}\n')
    with pytest.raises(InputError, match="unknown metric 'bleu'"):
        eval_command(model, str(tmp_path / "m.jsonl"))


def test_demo_command_without_checkpoint(monkeypatch, tmp_path):
    import trimvlm.loading
    from trimvlm.cli_eval import demo_command

    with pytest.raises(InputError, match="limit must be a positive number of items"):
        demo_command(limit=-1, json_out=None, png_out=None)
    monkeypatch.setattr(trimvlm.loading, "DEMO_DIR", tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"demo checkpoint 'demo' is not shipped.*trimvlm train-demo"):
        demo_command(limit=6, json_out=tmp_path / "d.json", png_out=tmp_path / "d.png")
    assert not (tmp_path / "d.json").exists()


def test_demo_command_on_shipped_checkpoint(tmp_path):
    from rich.console import Console

    from trimvlm.cli_eval import demo_command

    data = demo_command(
        limit=12,
        json_out=tmp_path / "d.json",
        png_out=tmp_path / "d.png",
        recipes=[],
        progress=False,
        console=Console(file=open(tmp_path / "log.txt", "w")),  # noqa: SIM115
    )
    assert data["task"]["name"] == "demo" and data["task"]["items"] == 12
    assert (tmp_path / "d.json").exists() and (tmp_path / "d.png").exists()


# --------------------------------------------------------------------------------------------- one harness

MIXED_RECIPES = ["tokens=density:keep=0.5:layer=3", "kv=density:keep=0.25", "depth=tail:budget=2"]


def test_one_loop_runs_generation_and_candidate_items_alike():
    """One task holding generation records and candidate items, three recipes of different axes: every item's
    output is the one that item gets alone from vlm.generate / vlm.score (what the two loops gave before)."""
    import trimvlm
    from trimvlm.evals.items import CandidateItem
    from trimvlm.evals.tasks import demo_candidate_task

    torch.set_num_threads(1)
    vlm = trimvlm.load("demo")
    gen, cand = demo_task(limit=12, seed=2), demo_candidate_task(limit=12, seed=3)
    task = Task("mixed", gen.records + cand.records, max_new_tokens=gen.max_new_tokens,
                kind_max_new_tokens=gen.kind_max_new_tokens)  # fmt: skip
    res = run_eval(vlm, task, MIXED_RECIPES, batch_size=4, warmup=False, memory="off", progress=False)
    assert res.labels == ["baseline", *MIXED_RECIPES]
    for r, recipe in enumerate(res.recipes):
        for i, item in enumerate(task.records):
            if isinstance(item, CandidateItem):
                alone = vlm.score([item.request()], readout=res.settings["readout"], recipe=recipe).results[0].chosen
            else:
                n_new = task.new_tokens(item.probe, item.kind)
                alone = vlm.generate([list(item.images)], [item.prompt_text()], recipe=recipe,
                                     max_new_tokens=n_new).texts[0]  # fmt: skip
            assert res.predictions[r][i] == alone, (recipe.label(), item.id)
    groups = {row["group"] for row in res.rows}
    assert {"prefill", "full", "candidates", "all"} <= groups
    cands = res.row("depth=tail:budget=2", "candidates")
    assert cands["ratio"]["branch_flops"] < 1.0 and res.row("baseline", "prefill")["ratio"]["branch_flops"] is None
    assert res.depths[3]["skipped_branch"] == [3, 4] and res.depths[0] is None
    kv = res.row("kv=density:keep=0.25", "full")["costs"]["per_item"]
    assert kv["kv_bytes"] < kv["kv_bytes_peak"]  # eviction: less KV kept than held at the peak


def test_one_registry_lists_every_task():
    from trimvlm.cli_eval import task_list
    from trimvlm.evals.tasks import TASKS, benchmarks, calibration_items
    from trimvlm.testing.cli import run_cli

    assert set(TASKS) == {"demo", "demo-candidates", "demo-decisions", "scenes", "scenes-candidates", *benchmarks()}
    assert set(benchmarks()) == {"pope", "scienceqa_img", "mmbench", "ai2d", "textvqa", "docvqa", "infovqa",
                                 "chartqa", "mmvet"}  # fmt: skip
    listed = [line.split(":")[0] for line in task_list().splitlines()]
    assert listed == sorted(TASKS)
    text = run_cli("eval", "--help").output
    assert all(name in text for name in TASKS) and "--threads" in text and "--limit" in text
    assert get_task("demo-candidates", limit=3).records[0].probe == "candidates"
    # calibration picks its inputs from the same registry: the val split, candidates from the paired task
    val = calibration_items("demo", 4, 0)
    assert len(val) == 4 and val[0].id.startswith("val-") and val[0].probe == "prefill"
    assert calibration_items("demo", 4, 0, candidates=True)[0].candidates
    with pytest.raises(InputError, match=r"unknown calibration task 'pope'; allowed: demo, demo-candidates"):
        calibration_items("pope", 4, 0)


def test_threads_option_sets_torch_threads(monkeypatch):
    from trimvlm.cli_eval import eval_command

    monkeypatch.setattr(torch, "set_num_threads", lambda n: (_ for _ in ()).throw(RuntimeError(f"threads {n}")))
    with pytest.raises(RuntimeError, match="threads 3"):
        eval_command("demo", "demo", limit=2, threads=3)
    with pytest.raises(InputError, match="threads must be a positive number of torch threads"):
        eval_command("demo", "demo", limit=2, threads=0)


def test_one_loop_runs_generation_candidate_and_decision_items():
    """One task holding the three item kinds runs in the one interleaved loop: each kind in batches of its own,
    reported under its probe; a decision item's output is what `vlm.decide` answers its request alone, and its
    score the fraction of its questions answered as expected."""
    import trimvlm
    from trimvlm.evals.items import picked

    torch.set_num_threads(1)
    vlm = trimvlm.load("demo")
    gen, cand, dec = (get_task(n, limit=k) for n, k in (("demo", 6), ("demo-candidates", 3), ("demo-decisions", 3)))
    mixed = Task(name="mixed", records=gen.records + cand.records + dec.records, max_new_tokens=gen.max_new_tokens,
                 kind_max_new_tokens=gen.kind_max_new_tokens)  # fmt: skip
    res = run_eval(vlm, mixed, ["tokens=fastv:keep=0.5:layer=2"], batch_size=2, progress=False)
    probes = {r["group"] for r in res.rows if r["group_type"] == "probe"}
    assert probes == {"prefill", "full", "candidates", "decision"}
    first = len(gen.records) + len(cand.records)
    for r, recipe in enumerate([None, "tokens=fastv:keep=0.5:layer=2"]):
        for i, item in enumerate(dec.records):
            alone = {q: picked(a) for q, a in vlm.decide(item.request, recipe=recipe).items()}
            assert res.predictions[r][first + i] == alone
            expected = sum(alone[q] == a for q, a in item.answers.items()) / len(item.answers)
            assert res.scores[r][first + i] == expected
    row = res.row("tokens=fastv:keep=0.5:layer=2", "decision")
    assert row["n"] == 3 and set(row["by_question"]) == {"exist", "mc", "count"}
    assert 0 < row["ratio"]["prefill_flops"] < 1
