"""Rows that read a shared prompt (n choices, `KVCache.share_prefix`) join a running decode batch without copying
it (`KVCache.join`: each shared part read through its owners, -1 for the rows that do not read it): every row's
logits equal its decoding alone, the parts are the prefills' own tensors, and a part no row reads is let go.
Through the server, two n > 1 requests and a plain one decode in one batch and each answer equals alone."""

import threading

import pytest
import torch
from conftest import live, need_extra

from trimvlm.runtime.generate import Decoding
from trimvlm.runtime.meter import Meter

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6


def _decoding(runner, prep, n: int):
    """(a Decoding of n rows off one prefill of `prep`: its own cache for n = 1, else branches of it; logits)."""
    out = runner.prefill(prep)
    if n == 1:
        return Decoding(runner, out.cache, out.next_pos.clone()), out.logits, out
    owner = torch.zeros(n, dtype=torch.long)
    cache = out.cache.share_prefix(owner)
    return Decoding(runner, cache, out.next_pos.index_select(0, owner).clone()), out.logits.index_select(0, owner), out


def _greedy(dec, logits, steps=STEPS):
    seen = []
    for _ in range(steps):
        tok = logits.argmax(-1)
        seen.append(logits.clone())
        logits = dec.step(tok, Meter())
    return seen


def test_branches_join_a_plain_batch_uncopied(demo):
    from test_serve_engine import image

    runner = demo.runner
    preps = [demo.prepare(image(3), "describe ?"), demo.prepare(image(4), "read text ?"),
             demo.prepare(image(5), "list row r1 ?")]  # fmt: skip
    ns = [1, 2, 3]
    alone = [_greedy(*_decoding(runner, p, n)[:2]) for p, n in zip(preps, ns, strict=True)]
    made = [_decoding(runner, p, n) for p, n in zip(preps, ns, strict=True)]
    dec, logits = made[0][0], made[0][1]
    for d, lg, _ in made[1:]:
        dec.join(d)
        logits = torch.cat([logits, lg])
    parts = dec.cache.prefix.parts
    assert [p.owner.tolist() for p in parts] == [[-1, 0, 0, -1, -1, -1], [-1, -1, -1, 0, 0, 0]]
    assert all(p.layers[0].key is m[2].cache.layers[0].key for p, m in zip(parts, made[1:], strict=True))
    joined = _greedy(dec, logits)
    rows = [0, 1, 1, 2, 2, 2]  # which request each row is
    for t in range(STEPS):
        for r, k in enumerate(rows):
            torch.testing.assert_close(joined[t][r], alone[k][t][r - rows.index(k)], atol=1e-5, rtol=1e-5)
    dec.keep(torch.tensor([0, 3, 4, 5]))  # the 2-choice request's rows leave: its part is let go
    assert [p.owner.tolist() for p in dec.cache.prefix.parts] == [[-1, 0, 0, 0]]
    dec.keep(torch.tensor([0]))
    assert dec.cache.prefix is None


def test_shared_parts_are_counted_for_the_rows_that_read_them(demo):
    """A step of the joined batch costs less than counting every row over every part's keys: a part's
    attention is booked for its readers only."""
    from test_serve_engine import image

    runner = demo.runner
    a, la, _ = _decoding(runner, demo.prepare(image(3), "describe ?"), 1)
    b, lb, out_b = _decoding(runner, demo.prepare(image(4), "read text ?"), 3)
    a.join(b)
    meter = Meter()
    a.step(torch.cat([la, lb]).argmax(-1), meter)
    ad, cfg = demo.adapter, demo.adapter.text_config
    k_part = out_b.cache.layers[0].key.shape[2]
    own = a.cache.layers[0].key.shape[2]  # after the step: the padded own columns, the new token included
    every = sum(ad.layer_flops(i, 4, 1, own + k_part) for i in range(cfg.num_hidden_layers))
    readers = sum(ad.layer_flops(i, 4, 1, own) + ad.layer_flops(i, 3, 1, k_part) - ad.layer_flops(i, 3, 1, 0)
                  for i in range(cfg.num_hidden_layers))  # fmt: skip
    assert meter.costs.flops["decode"] - ad.head_flops(4, 1) == readers < every


def test_n_requests_and_a_plain_one_decode_in_one_batch(demo, monkeypatch):
    need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")
    from test_serve_engine import WAIT_S, HeldSteps, client, image, messages, wait_for

    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.state import ServerState

    refs = {s: [demo.generate(image(s), "describe ?", max_new_tokens=16, temperature=1.0, seed=9 + i).texts[0]
                for i in range(n)] for s, n in ((3, 1), (4, 3), (5, 2))}  # fmt: skip
    state = ServerState(demo, model_id="demo", caches=CacheSizes(prefix_mb=0, vision_mb=0, request_mb=0))
    held, gate = HeldSteps(demo.runner, monkeypatch), threading.Event()
    held.hold = lambda rows: gate if rows == 1 else None  # A's first steps wait until the others are queued
    out = {}

    def ask(s, n):
        r = client(url).chat.completions.create(model="demo", messages=messages(s), max_tokens=16, temperature=1.0,
                                                seed=9, n=n)  # fmt: skip
        out[s] = [c.message.content for c in r.choices]

    with live(state) as (url, _):
        threads = [threading.Thread(target=ask, args=(3, 1))]
        threads[0].start()
        wait_for(lambda: held.rows, "A to decode")
        threads += [threading.Thread(target=ask, args=(s, n)) for s, n in ((4, 3), (5, 2))]
        for t in threads[1:]:
            t.start()
        wait_for(lambda: state.batcher.waiting() == 2, "the n requests to be queued")
        gate.set()
        for t in threads:
            t.join(WAIT_S)
    assert out == refs
    assert max(held.rows) == 6 and len(state.batcher.engine.groups) == 0  # one batch of 1 + 3 + 2 rows


def test_branches_off_recurrent_states_decode_apart(vlms):
    """A hybrid model's branches read their prompt's recurrent states as shared views: such caches are not
    joined (ValueError), and the engine keeps their rows as a decode group of their own."""
    from trimvlm.testing import random_image

    vlm = vlms("qwen3_5")
    runner = vlm.runner
    a, _, _ = _decoding(runner, vlm.prepare([random_image(1, (64, 64))], "describe"), 1)
    b, _, _ = _decoding(runner, vlm.prepare([random_image(2, (64, 64))], "what color"), 2)
    with pytest.raises(ValueError, match="recurrent"):
        a.join(b)
    assert len(a) == 1 and len(b) == 2  # nothing changed
