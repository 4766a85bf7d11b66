"""The decision head: forward, save/load, seeded training on cached features, the shipped demo heads."""

import json

import numpy as np
import pytest
import torch

import trimvlm
from trimvlm.cli_train import train_head_command
from trimvlm.demo.task import generate_split
from trimvlm.errors import CheckpointError, InputError, TrimVLMError
from trimvlm.scoring import train_head as th
from trimvlm.scoring.head import CONFIG, WEIGHTS, DecisionHead
from trimvlm.testing import random_image
from trimvlm.vlm import VLM

DEMOS = ["demo", "demo-qwen35"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def demo_vlms():
    torch.set_num_threads(1)
    return {name: trimvlm.load(name) for name in DEMOS}


def _random_head(seed=0, d=16, width=8):
    torch.manual_seed(seed)
    head = DecisionHead(d, width)
    with torch.no_grad():
        head.log_tau.fill_(0.3)
    return head


def test_forward_shapes_and_abstain():
    head = _random_head()
    g = torch.Generator().manual_seed(1)
    z_q, u, feats = torch.randn(3, 16, generator=g), torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 6)
    logits, abstain = head(z_q, u, feats)
    assert logits.shape == (3, 5) and abstain.shape == (3,)
    # the formula, written out
    tau = head.log_tau.exp()
    gate = torch.tanh(head.w_q(z_q))
    h = head.w_o(u) * gate[:, None] + head.w_f(feats)
    want = (h @ head.w.weight[0] + feats @ head.v.weight[0]) / tau
    assert torch.allclose(logits, want, atol=1e-6)
    assert torch.allclose(abstain, head.w_a(gate)[:, 0] / tau, atol=1e-6)
    # abstention reads the question only; candidates are scored independently of each other
    logits2, abstain2 = head(z_q, torch.randn(3, 5, 16, generator=g), feats)
    assert torch.equal(abstain, abstain2) and not torch.allclose(logits, logits2)
    l_part, _ = head(z_q, u[:, :2], feats[:, :2])
    assert torch.allclose(l_part, logits[:, :2], atol=1e-6)
    # FLOPs: by hand from the sizes (d = 16, width 8, 6 features): w_q d x w and w_a w x 1 once, per candidate
    # w_o d x w, w_f f x w, the w and v read-outs; 2 per multiply-add; and what torch counts on the forward
    d, w, f = 16, 8, 6
    for n in (1, 5):
        assert head.flops(n) == 2 * (d * w + w + n * (d * w + f * w + w + f))
    from trimvlm.runtime.meter import flop_counter

    with flop_counter() as fc:
        head(z_q, u, feats)
    assert fc.get_total_flops() == 3 * head.flops(5)


def test_save_load_round_trip(tmp_path):
    head = _random_head(3)
    head.save(tmp_path, meta={"test_accuracy": {"all": 1.0}})
    back = DecisionHead.load(tmp_path)
    assert not back.training
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    z_q, u, f = torch.randn(2, 16), torch.randn(2, 4, 16), torch.randn(2, 4, 6)
    for x, y in zip(head(z_q, u, f), back(z_q, u, f), strict=True):
        assert torch.equal(x, y)
    cfg = json.loads((tmp_path / CONFIG).read_text())
    assert cfg["hidden_size"] == 16 and cfg["width"] == 8 and cfg["test_accuracy"] == {"all": 1.0}
    assert DecisionHead.load(tmp_path / "nothing") is None and DecisionHead.load(None) is None
    cfg["hidden_size"] = 32  # weights no longer match the config
    (tmp_path / CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match"):
        DecisionHead.load(tmp_path)


@pytest.fixture(scope="module")
def small_cache(demo_vlms):
    torch.set_num_threads(1)
    vlm = demo_vlms["demo"]
    rng = np.random.default_rng(0)
    train = th.make_items(generate_split("train", 4), 0.25, rng)
    val = th.make_items(generate_split("val", 2), 0.25, rng)
    return vlm, th.extract(vlm, train), th.extract(vlm, val), train


@pytest.fixture(scope="module")
def small_binary(demo_vlms):
    torch.set_num_threads(1)
    vlm = demo_vlms["demo"]
    rng = np.random.default_rng(1)
    train = th.make_binary_items(generate_split("train", 4), rng)
    val = th.make_binary_items(generate_split("val", 2), rng)
    return th.extract(vlm, train), th.extract(vlm, val), train


def test_items_and_cache(small_cache):
    vlm, train, _, items = small_cache
    removed = [it for it in items if it.target is None]
    assert len(removed) == 6 and all(
        len(it.candidates) >= 2 and it.answer not in it.candidates for it in removed
    )
    assert all(it.candidates[it.target] == it.answer for it in items if it.target is not None)
    n = train.mask.shape[1]
    assert n == max(len(it.candidates) for it in items)
    assert train.u.shape == (len(items), n, vlm.adapter.text_config.hidden_size)
    assert train.mask.sum(1).tolist() == [len(it.candidates) for it in items]
    assert int(train.abstains.sum()) == len(removed)
    assert torch.isinf(train.sums[~train.mask]).all() and (train.u[~train.mask] == 0).all()


def test_training_is_seeded(small_cache):
    vlm, train, val, _ = small_cache
    d = vlm.adapter.text_config.hidden_size
    runs = [
        th.train(d, train, val, th.Settings(steps=30, eval_every=10, batch_size=8, seed=s))[0]
        for s in (0, 0, 1)
    ]
    a, b, c = (r.state_dict() for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # training on the cache moved the loss down from the untrained head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fresh = DecisionHead(d, 64)
    with torch.no_grad():
        assert float(th.loss_of(runs[0], train)) < float(th.loss_of(fresh, train))


def test_binary_items_and_training(small_cache, small_binary):
    vlm, train, val, _ = small_cache
    b_train, b_val, items = small_binary
    assert [it.kind for it in items] == ["exist", "color"] * 4 and all(it.binary for it in items)
    for it in items:
        assert len(it.candidates) == 1 and it.request.binary
        assert it.target == int(it.candidates[0] == it.answer)
        if it.kind == "exist":
            assert it.candidates[0] == "yes"
    # features of a binary request: N = 1, as the readout sees it; never an abstention item
    assert b_train.mask.shape[1] == 1 and b_train.binary.all() and not b_train.abstains.any()
    assert not train.binary.any()
    d = vlm.adapter.text_config.hidden_size
    s = th.Settings(steps=30, eval_every=10, batch_size=8, binary_batch_size=4, seed=0)
    runs = [th.train(d, train, val, s, binary_train=b_train, binary_val=b_val) for _ in range(2)]
    (a, fit), (b, _) = runs
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert all("val_binary_accuracy" in h for h in fit["history"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fresh = DecisionHead(d, 64)
    with torch.no_grad():
        assert float(th.loss_of(a, b_train)) < float(th.loss_of(fresh, b_train))
    pred = th.predictions(a, b_train)
    assert set(pred.tolist()) <= {0, 1}
    # without binary sets the choice stream is the one it always was
    plain, _ = th.train(d, train, val, s)
    zero, _ = th.train(
        d, train, val, th.Settings(**{**s.as_dict(), "binary_weight": 0.0}), binary_train=b_train
    )
    assert all(torch.equal(plain.state_dict()[k], zero.state_dict()[k]) for k in plain.state_dict())


@pytest.mark.parametrize("name", DEMOS)
def test_shipped_head(name, demo_vlms):
    vlm = demo_vlms[name]
    assert vlm.head is not None
    meta = json.loads((vlm.adapter.folder / CONFIG).read_text())
    assert (vlm.adapter.folder / WEIGHTS).exists()
    assert min(meta["test_accuracy"].values()) >= 0.95, meta["test_accuracy"]
    samples = generate_split("test", 5)
    qas = [(s, q) for s in samples for q in s.qas]
    out = vlm.score(
        [[s.image] for s, _ in qas],
        [q.question for _, q in qas],
        [q.candidates for _, q in qas],
        readout="head",
    )
    assert out.readout == "head"
    first = out.results
    right = [r.chosen_text == q.answer for (_, q), r in zip(qas, out.results, strict=True)]
    assert sum(right) / len(right) >= 0.9
    for r in out.results:  # P(abstain): the last entry of the softmax over [logit_1 .. logit_N, abstain]
        z = np.array([*r.logits, r.abstain_logit])
        assert r.abstain_prob == pytest.approx(np.exp(z[-1] - z.max()) / np.exp(z - z.max()).sum())
    # the right answer removed: the head should mostly abstain (measured ~96-98% on the test split)
    kept = [(s, q) for s, q in qas if len(q.candidates) >= 3]
    out = vlm.score(
        [[s.image] for s, _ in kept],
        [q.question for _, q in kept],
        [[c for c in q.candidates if c != q.answer] for _, q in kept],
        readout="head",
    )
    abstained = [r.chosen == -1 and r.chosen_text is None for r in out.results]
    assert sum(abstained) / len(abstained) >= 0.6
    present = [r.abstain_prob for (_, q), r in zip(qas, first, strict=True) if len(q.candidates) >= 3]
    removed = [r.abstain_prob for r in out.results]
    assert np.mean(removed) > np.mean(present) + 0.5


@pytest.mark.parametrize("name", DEMOS)
def test_shipped_head_binary(name, demo_vlms):
    """Binary requests (one statement, P(true) = sigmoid(logit)): trained and measured (>= 95% per kind on
    the test split); here a handful of test items, the right and a wrong colour for each colour question."""
    vlm = demo_vlms[name]
    meta = json.loads((vlm.adapter.folder / CONFIG).read_text())
    assert set(meta["test_binary_accuracy"]) == {*th.BINARY_KINDS, "all"}
    assert min(meta["test_binary_accuracy"].values()) >= 0.95, meta["test_binary_accuracy"]
    asks = []  # (image, question, statement, true?)
    for s in generate_split("test", 6):
        for q in s.qas:
            if q.kind == "exist":
                asks.append((s.image, q.question, "yes", q.answer == "yes"))
            elif q.kind == "color":
                wrong = next(c for c in q.candidates if c != q.answer)
                asks += [(s.image, q.question, q.answer, True), (s.image, q.question, wrong, False)]
    truth = [t for *_, t in asks]
    assert any(truth) and not all(truth)
    out = vlm.score(
        [[img] for img, *_ in asks],
        [q for _, q, *_ in asks],
        [[c] for _, _, c, _ in asks],
        readout="head",
        binary=True,
    )
    probs = [r.binary_prob for r in out.results]
    logits = [r.candidates[0].logit for r in out.results]
    assert probs == pytest.approx([1 / (1 + np.exp(-x)) for x in logits])  # P(true) = sigmoid(the logit)
    for r, p in zip(out.results, probs, strict=True):
        assert r.abstain_prob is None and r.chosen == (0 if p >= 0.5 else -1)
        assert r.candidates[0].prob == pytest.approx(p)
    right = [(p >= 0.5) == t for p, t in zip(probs, truth, strict=True)]
    assert sum(right) / len(right) >= 0.85, list(zip(probs, truth, strict=True))
    p_true = np.mean([p for p, t in zip(probs, truth, strict=True) if t])
    p_false = np.mean([p for p, t in zip(probs, truth, strict=True) if not t])
    assert p_true - p_false > 0.5
    # the training features of a binary item are what the readout sees (N = 1)
    items = [th.Item(img, q, [c], "", "x", int(t), binary=True) for img, q, c, t in asks[:4]]
    with torch.no_grad():
        cached = torch.sigmoid(th.scores(vlm.head, th.extract(vlm, items))[:, 0])
    assert torch.allclose(cached, torch.tensor(probs[:4]), atol=1e-3)


@pytest.mark.parametrize("readout", ["head", "loglik"])
def test_binary_request_needs_one_candidate(readout, demo_vlms):
    vlm = demo_vlms["demo"]
    img = generate_split("test", 1)[0].image
    with pytest.raises(InputError, match="a binary request has exactly one candidate statement"):
        vlm.score(img, "is there a red circle ?", ["yes", "no"], readout=readout, binary=True)
    with pytest.raises(InputError, match="request 1: a binary request has exactly one candidate statement"):
        vlm.score(
            [img, img],
            ["is there a red circle ?", "color at r0 c0 ?"],
            [["yes"], ["red", "blue"]],
            readout=readout,
            binary=True,
        )


def test_head_readout_needs_a_head(tiny_adapter):
    vlm = VLM(tiny_adapter("qwen3_vl"))
    assert vlm.head is None
    with pytest.raises(TrimVLMError, match="train-head"):
        vlm.score(random_image(0, (64, 64)), "what is it", ["a", "b"], readout="head")


def test_train_head_command_refuses(tmp_path):
    with pytest.raises(TrimVLMError, match="checkpoint not found"):
        train_head_command(str(tmp_path / "missing"), None, steps=10, items=60, seed=0)
    with pytest.raises(InputError, match="--steps"):
        train_head_command("demo", None, steps=0, items=60, seed=0)
    with pytest.raises(InputError, match="--items"):
        train_head_command("demo", None, steps=10, items=3, seed=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        train_head_command("demo", tmp_path / "file", steps=10, items=60, seed=0)
