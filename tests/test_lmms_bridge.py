"""The lmms-eval bridge (trimvlm.integrations.lmms): `python -m lmms_eval --model trimvlm` runs two small
lmms-eval tasks end to end on the demo model from a local parquet fixture (POPE's own lmms-eval functions on
yes/no questions, a multiple-choice task scored by log-likelihood); generate_until equals VLM.generate,
loglikelihood equals a log-likelihood from transformers' own forward; requests the bridge cannot express are
refused clearly. No hub: the test writes its data, HF_*_OFFLINE=1. Needs lmms-eval (`make lmms`)."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import RunnerCalls, fail_if_required

try:
    import lmms_eval  # noqa: F401
    from lmms_eval.api.instance import Instance

    LMMS_ERROR = None
except Exception as e:  # ImportError, or lmms-eval failing to import beside this torch
    LMMS_ERROR = f"lmms-eval cannot be imported ({type(e).__name__}: {e}); `make lmms` installs it"

fail_if_required(LMMS_ERROR)
pytestmark = pytest.mark.skipif(LMMS_ERROR is not None, reason=str(LMMS_ERROR))

RECIPE = "tokens=density:keep=0.5:layer=3"
N_IMAGES = 8  # demo images: one yes/no and one multiple-choice question each


@pytest.fixture(scope="module")
def vlm():
    import trimvlm

    torch.set_num_threads(1)
    return trimvlm.load("demo")


@pytest.fixture(scope="module")
def records():
    from trimvlm.evals.tasks import get_task

    recs = get_task("demo", limit=6 * N_IMAGES).records
    return {k: [r for r in recs if r.kind == k] for k in ("exist", "mc", "read")}


def _bridge(vlm, **kw):
    from trimvlm.integrations.lmms import TrimVLM

    return TrimVLM(vlm=vlm, **kw)


def _docs(recs):
    return [{"question": r.question, "answer": r.answers[0], "image": r.images[0]} for r in recs]


def _req(kind, args, doc_id, task="t"):
    return Instance(kind, args, 0, {"task": task, "doc_id": doc_id, "repeats": 1})


def _visual(doc):
    return [doc["image"]]


def test_entry_point_resolves_to_the_bridge():
    from importlib.metadata import entry_points

    from lmms_eval.models import get_model

    from trimvlm.integrations.lmms import TrimVLM

    assert "trimvlm" in {ep.name for ep in entry_points(group="lmms_eval.models")}
    assert get_model("trimvlm") is TrimVLM


def test_generate_until_equals_vlm_generate(vlm, records):
    recs = records["exist"] + records["read"]
    docs = _docs(recs)
    m = _bridge(vlm, tokens="density:keep=0.5:layer=3", batch_size=3)
    m.task_dict = {"t": {"test": docs}}
    gen = {"max_new_tokens": 6, "temperature": 0, "do_sample": False, "until": [" "]}
    reqs = [
        _req("generate_until", (d["question"], dict(gen), _visual, i, "t", "test"), i)
        for i, d in enumerate(docs)
    ]
    out = m.generate_until(reqs)
    ref = vlm.generate(
        [[d["image"]] for d in docs], [d["question"] for d in docs], recipe=RECIPE, max_new_tokens=6
    )
    assert out == [t.split(" ")[0] for t in ref.texts]  # `until` cuts at the first stop string
    assert any(" " in t for t in ref.texts)  # ("1 4 C B": the cut did something)
    assert m.costs["generate_until"]["total_flops"] > 0


def test_loglikelihood_equals_transformers_forward(vlm, records):
    recs = records["mc"][:3] + records["read"][:2]
    docs = _docs(recs)
    m = _bridge(vlm, executor="tree", batch_size=2)
    m.task_dict = {"t": {"test": docs}}
    reqs, want = [], []
    ad = vlm.adapter
    for i, d in enumerate(docs):
        choices = list("ABCD") if d["answer"] in "ABCD" else [d["answer"], "1 4 C B", "0"]
        for c in choices:
            reqs.append(_req("loglikelihood", (d["question"], " " + c, _visual, i, "t", "test"), i))
            prep = ad.prepare([[d["image"]]], [d["question"]])
            cont = torch.tensor([ad.tokenizer(c, add_special_tokens=False)["input_ids"]])
            ids = torch.cat([prep.input_ids, cont], 1)
            mask = torch.cat([prep.attention_mask, torch.ones_like(cont)], 1)
            extra = dict(prep.model_inputs)
            if "mm_token_type_ids" in extra:  # text tokens: type 0
                extra["mm_token_type_ids"] = torch.cat(
                    [extra["mm_token_type_ids"], torch.zeros_like(cont)], 1
                )
            with torch.no_grad():
                logits = ad.model(input_ids=ids, attention_mask=mask, **extra).logits[0]
            steps = torch.log_softmax(logits.double(), -1)[-cont.shape[1] - 1 : -1]
            lp = steps.gather(1, cont[0][:, None]).sum().item()
            want.append((-lp, bool((steps.argmax(-1) == cont[0]).all())))
    from lmms_eval.api.instance import unwrap_generation_output

    got = [unwrap_generation_output(x)[0] for x in m.loglikelihood(reqs)]
    for (nll, greedy), (ref_nll, ref_greedy) in zip(got, want, strict=True):
        assert abs(nll - ref_nll) <= 1e-4 and greedy == ref_greedy
    assert m.costs["loglikelihood"]["model_flops"] > 0


def test_requests_the_bridge_cannot_express(vlm, records):
    from trimvlm.errors import InputError, RecipeError

    docs = _docs(records["mc"][:1])
    m = _bridge(vlm)
    m.task_dict = {"t": {"test": docs}}
    with pytest.raises(InputError, match="acc_mutual_info"):  # the unconditional requests: ("", choice)
        m.loglikelihood([_req("loglikelihood", ("", " A"), 0)])
    with pytest.raises(NotImplementedError, match="multi-round"):
        m.generate_until_multi_round([])
    with pytest.raises(InputError, match="beam search"):
        m.generate_until([_req("generate_until", ("q", {"num_beams": 3}, _visual, 0, "t", "test"), 0)])
    with pytest.raises(InputError, match="not video or audio"):
        m.generate_until([_req("generate_until", ("q", {}, lambda d: ["clip.mp4"], 0, "t", "test"), 0)])
    with pytest.raises(InputError, match="unknown trimvlm model arg"):
        _bridge(vlm, temperature=0.5)
    with pytest.raises(RecipeError, match="given twice"):
        _bridge(vlm, recipe=f'"{RECIPE}"', tokens="density:keep=0.25:layer=2")
    with pytest.raises(InputError, match="unknown executor"):
        _bridge(vlm, executor="fast")
    # a quoted two-axis recipe (lmms-eval splits model args on unquoted commas), or one model arg per axis
    both = _bridge(vlm, recipe=f'"{RECIPE},kv=density:keep=0.25"')
    assert both.recipe == _bridge(vlm, tokens="density:keep=0.5:layer=3", kv="density:keep=0.25").recipe


POPE_YAML = """task: trimvlm_demo_pope
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.pope_doc_to_visual
doc_to_text: !function utils.pope_doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 8
  temperature: 0
  do_sample: false
process_results: !function utils.pope_process_results
metric_list:
  - metric: pope_accuracy
    aggregation: !function utils.pope_aggregate_accuracy
    higher_is_better: true
  - metric: pope_f1_score
    aggregation: !function utils.pope_aggregate_f1_score
    higher_is_better: true
lmms_eval_specific_kwargs:
  default:
    pre_prompt: ""
    post_prompt: ""
"""

MC_YAML = """task: trimvlm_demo_mc
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_visual: !function utils.pope_doc_to_visual
doc_to_text: question
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _write_tasks(folder, records):
    """Two lmms-eval tasks over parquet files in the Hugging Face datasets layout (embedded image bytes,
    the `Image` feature in the schema), as the lmms-lab copies publish them."""
    import datasets

    folder.mkdir()
    feats = {"question_id": datasets.Value("string"), "question": datasets.Value("string")}
    ex, mc = records["exist"], records["mc"]
    datasets.Dataset.from_dict(
        {"question_id": [r.id for r in ex], "question": [r.question for r in ex],
         "answer": [r.answers[0] for r in ex], "image": [r.images[0] for r in ex]},
        features=datasets.Features(feats | {"answer": datasets.Value("string"), "image": datasets.Image()}),
    ).to_parquet(str(folder / "pope.parquet"))  # fmt: skip
    datasets.Dataset.from_dict(
        {"question_id": [r.id for r in mc], "question": [r.question for r in mc],
         "answer": ["ABCD".index(r.answers[0]) for r in mc], "image": [r.images[0] for r in mc]},
        features=datasets.Features(feats | {"answer": datasets.Value("int64"), "image": datasets.Image()}),
    ).to_parquet(str(folder / "mc.parquet"))  # fmt: skip
    (folder / "pope.yaml").write_text(POPE_YAML.format(data=folder / "pope.parquet"))
    (folder / "mc.yaml").write_text(MC_YAML.format(data=folder / "mc.parquet"))
    # lmms-eval's own POPE functions (doc_to_visual, doc_to_text, process_results, aggregations)
    (folder / "utils.py").write_text("from lmms_eval.tasks.pope.utils import *  # noqa: F401,F403\n")


def test_lmms_eval_cli_runs_two_tasks_end_to_end(tmp_path, vlm, records):
    tasks = tmp_path / "tasks"
    _write_tasks(tasks, records)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "trimvlm",
           "--model_args", f"pretrained=demo,device=cpu,{RECIPE},executor=tree", "--batch_size", "4",
           "--tasks", "trimvlm_demo_pope,trimvlm_demo_mc", "--include_path", str(tasks),
           "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, log
    found = glob.glob(str(tmp_path / "out" / "**" / "*_results.json"), recursive=True)
    assert len(found) == 1, log
    results = json.loads(open(found[0]).read())["results"]

    # generate_until: lmms-eval's POPE scoring of exactly what VLM.generate answers under the recipe
    ex = records["exist"]
    ref = vlm.generate(
        [list(r.images) for r in ex], [r.question for r in ex], recipe=RECIPE, max_new_tokens=8
    )
    samples = glob.glob(str(tmp_path / "out" / "**" / "*_samples_trimvlm_demo_pope.jsonl"), recursive=True)
    got = {json.loads(x)["doc_id"]: json.loads(x)["filtered_resps"] for x in open(samples[0])}
    assert [got[i] for i in range(len(ex))] == ref.texts
    want_acc = sum(t == r.answers[0] for t, r in zip(ref.texts, ex, strict=True)) / len(ex)
    assert results["trimvlm_demo_pope"]["pope_accuracy,none"] == pytest.approx(want_acc)
    assert want_acc >= 0.75  # the demo model answers its own yes/no questions

    # loglikelihood: the option with the least NLL, under the recipe, per doc
    mc = records["mc"]
    m = _bridge(vlm, tokens="density:keep=0.5:layer=3")
    from trimvlm.scoring.request import ScoreRequest

    lls = m.continuation_logliks([ScoreRequest(list(r.images), r.question, list("ABCD")) for r in mc])
    picked = ["ABCD"[max(range(4), key=lambda k: row[k][0])] for row in lls]
    want_acc = sum(p == r.answers[0] for p, r in zip(picked, mc, strict=True)) / len(mc)
    assert results["trimvlm_demo_mc"]["acc,none"] == pytest.approx(want_acc)
    assert want_acc >= 0.75


def test_the_bridge_takes_the_one_runner_path(vlm, records, monkeypatch):
    """A bridge batch is one `vlm.generate` / `vlm.score` call: one `Runner.prefill` per batch, never a second
    pass for the log-probs."""
    docs = _docs(records["mc"][:3])
    calls = RunnerCalls(vlm.runner, monkeypatch)
    try:
        m = _bridge(vlm, batch_size=3)
        m.task_dict = {"t": {"test": docs}}
        gen = {"max_new_tokens": 2, "temperature": 0, "do_sample": False, "until": [" "]}
        m.generate_until([_req("generate_until", (d["question"], dict(gen), _visual, i, "t", "test"), i)
                          for i, d in enumerate(docs)])  # fmt: skip
        assert calls.prefills == 1
        reqs = [_req("loglikelihood", (d["question"], " " + c, _visual, i, "t", "test"), i)
                for i, d in enumerate(docs) for c in "AB"]  # fmt: skip
        m.loglikelihood(reqs)
        assert calls.prefills == 2  # the three questions' prefixes in one prefill, every choice a branch off it
    finally:
        calls.close()
