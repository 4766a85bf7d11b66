"""Chunked prefill (`Runner.prefill_chunked`, runtime/runner.py; the scheduler's `--max-prefill-tokens`): a prompt prefilled a few tokens
at a time equals the prompt prefilled whole, on every family (recurrent Gated DeltaNet layers included); behind
a real server a long prompt is prefilled in chunks between the running rows' decode steps, and every answer
equals the request alone."""

import threading

import pytest
import torch
from conftest import AVAILABLE, RunnerCalls, need_extra

from trimvlm.plan import make_plan
from trimvlm.recipe import parse_recipe
from trimvlm.runtime.generate import Decoding
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.runner import Prefill
from trimvlm.testing import random_image


def _greedy(runner, out, plan, steps: int) -> list[int]:
    rows, logits, tokens = Decoding(runner, out.cache, out.next_pos.clone(), plan.skip_decode), out.logits, []
    for _ in range(steps):
        tok = logits.argmax(-1)
        tokens.append(int(tok[0]))
        logits = rows.step(tok, Meter())
    return tokens


@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_equals_the_whole_prefill(vlms, family, chunk, one_thread):
    """Chunks of 1 and 7 tokens: the same first logits, next position, KV length, FLOPs of the layers within
    the attention's share, and the same greedy continuation as one whole prefill."""
    vlm = vlms(family)
    runner = vlm.runner
    prepared = vlm.prepare([random_image(3, (64, 64))], "how many red circle are there")
    plan = make_plan(None, runner)
    whole = runner.prefill(prepared, plan, meter=Meter())
    meter = Meter()
    work = runner.prefill_chunked(prepared, plan, meter=meter)
    n, out = work.left, None
    advances = 0
    while out is None:
        out = work.advance(chunk)
        advances += 1
    assert advances == -(-n // chunk) and work.left == 0
    torch.testing.assert_close(out.logits, whole.logits, atol=2e-4, rtol=1e-4)
    assert torch.equal(out.next_pos, whole.next_pos)
    assert out.cache.get_seq_length(0) == whole.cache.get_seq_length(0)
    assert _greedy(runner, out, plan, 6) == _greedy(runner, whole, plan, 6)


def test_only_plans_that_read_nothing_of_the_whole_prefill_are_chunked(vlms):
    runner = vlms("qwen3_vl").runner
    assert make_plan(None, runner).chunkable
    assert make_plan(parse_recipe("depth=skip:layers=1"), runner).chunkable
    assert make_plan(parse_recipe("tokens=downsample:keep=0.25"), runner).chunkable  # acts when prepared
    assert not make_plan(parse_recipe("tokens=density:keep=0.5:layer=1"), runner).chunkable
    assert not make_plan(parse_recipe("kv=snapkv:keep=0.5"), runner).chunkable


def _a_then_b(demo, monkeypatch):
    """A decodes on a server with --max-prefill-tokens 16; B arrives while A's first step is held. Returns both
    answers, the chunk and step events in order, the runner's calls and the server state."""
    from conftest import live
    from test_serve_engine import WAIT_S, HeldSteps, client, messages, wait_for

    from trimvlm.serve.limits import ServerLimits
    from trimvlm.serve.state import ServerState

    events, lock = [], threading.Lock()
    real_advance = Prefill.advance

    def advance(self, n):
        with lock:
            events.append(("chunk", min(n, self.left)))
        return real_advance(self, n)

    monkeypatch.setattr(Prefill, "advance", advance)
    calls = RunnerCalls(demo.runner, monkeypatch)
    held = HeldSteps(demo.runner, monkeypatch)
    b_queued = threading.Event()

    def hold(rows):
        with lock:
            events.append(("step", rows))
        return b_queued if len(held.rows) == 1 else None

    held.hold = hold
    state = ServerState(demo, model_id="demo", limits=ServerLimits(max_prefill_tokens=16))
    out = {}
    try:
        with live(state) as (url, _):
            c = client(url)
            ta = threading.Thread(target=lambda: out.update(A=c.chat.completions.create(
                model="demo", messages=messages(3), max_tokens=24).choices[0].message.content))  # fmt: skip
            ta.start()
            wait_for(lambda: held.rows, "A to decode")
            tb = threading.Thread(target=lambda: out.update(B=c.chat.completions.create(
                model="demo", messages=messages(8, "read text ?"), max_tokens=24).choices[0].message.content))  # fmt: skip
            tb.start()
            wait_for(lambda: state.batcher.waiting() == 1, "B to be queued")
            b_queued.set()
            ta.join(WAIT_S)
            tb.join(WAIT_S)
    finally:
        b_queued.set()
        calls.close()
    return out, events, calls, state


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(monkeypatch):
    """--max-prefill-tokens 16: A decodes; B (a ~70-token prompt) arrives and is prefilled in ceil(70 / 16)
    chunks, one per turn, each followed by a decode step of A (A keeps getting tokens); B then joins A's
    batch. Both equal their answers alone; A's first request and B each take one vision encode."""
    need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")
    from test_serve_engine import image, solo

    import trimvlm

    torch.set_num_threads(1)
    demo = trimvlm.load("demo")
    ref_a, ref_b = solo(demo, 3).texts[0], solo(demo, 8, "read text ?").texts[0]
    tokens_a = int(demo.prepare(image(3), "describe ?").attention_mask.sum())
    tokens_b = int(demo.prepare(image(8), "read text ?").attention_mask.sum())
    assert len(solo(demo, 3).tokens[0]) >= 6
    out, events, calls, state = _a_then_b(demo, monkeypatch)
    assert out == {"A": ref_a, "B": ref_b}

    def pieces(n):
        return [16] * (n // 16) + ([n % 16] if n % 16 else [])

    chunks = [n for kind, n in events if kind == "chunk"]
    assert chunks == pieces(tokens_a) + pieces(tokens_b)  # A arrived alone at an idle server: chunked too
    start = events.index(("step", 1))  # A's first decode step: B's chunks come after it
    assert [n for kind, n in events[:start] if kind == "chunk"] == pieces(tokens_a)
    b = [i for i, e in enumerate(events) if e[0] == "chunk" and i > start]
    assert events[b[0] : b[-1]].count(("step", 1)) == len(b) - 1  # A stepped once after each of B's chunks
    assert ("step", 2) in events[b[-1] :]  # then B decoded in A's batch
    assert calls.prefills == 0  # no whole prefill: both ran in chunks
    assert state.batcher.stats()["prefill_chunks"] == len(chunks)
