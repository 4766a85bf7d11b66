"""What OpenAI clients send, through the official `openai` client against a live server (in this process, so the
tests can look at the model thread), each compared with the same request in process: `stop` (plain and
streamed: a partial match held back), `logprobs` / `top_logprobs`, `n` choices off one prefill (the prompt's
KV shared, not copied), `presence_penalty` / `frequency_penalty`, system messages and multi-turn
conversations (a follow-up turn prefills only its new tokens)."""

import pytest
import torch
from conftest import RunnerCalls, live, need_extra

need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")

from trimvlm.adapters.base import Conversation, Turn  # noqa: E402
from trimvlm.runtime.generate import Decoding, Sampling, penalize  # noqa: E402
from trimvlm.serve.limits import CacheSizes  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402
from trimvlm.serve.stops import StopText, token_start  # noqa: E402

from test_serve_engine import HeldSteps, client, data_url, image, messages  # noqa: E402  isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # (the demo model: conftest's `demo`)

MAX = 24


@pytest.fixture(scope="module")
def url(demo):
    with live(ServerState(demo, model_id="demo")) as (u, _):
        yield u


def ask(url, **kw):
    return client(url).chat.completions.create(model="demo", max_tokens=MAX, **kw)


# ---- stop ----
def test_stop_strings_cut_the_answer_where_one_first_appears(demo, url):
    ref = demo.generate(image(3), "describe ?", max_new_tokens=MAX)
    text, words = ref.texts[0], ref.texts[0].split()
    assert len(words) >= 6
    stop = " ".join(words[3:5])  # two tokens of the demo's word-level vocabulary
    want = text[: text.find(stop)]
    for stops in (stop, ["never said", stop]):
        r = ask(url, messages=messages(3), stop=stops)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == 5  # the tokens run: up to the one that completed the match
        chunks = list(ask(url, messages=messages(3), stop=stops, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
    lp = ask(url, messages=messages(3), stop=stop, logprobs=True).choices[0].logprobs.content
    assert [e.token for e in lp] == want.split()  # the tokens whose text was returned


def test_a_stream_holds_back_a_partial_match_until_it_is_resolved(demo, url):
    """stop = "<word 4> never": after word 4 the text could still become the stop string, so it is not sent;
    word 5 resolves it (no match) and both are sent together. The whole answer comes, finished as alone."""
    ref = demo.generate(image(3), "describe ?", max_new_tokens=MAX)
    words = ref.texts[0].split()
    chunks = list(ask(url, messages=messages(3), stop=f"{words[3]} never", stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == ref.texts[0]
    assert not any(p.strip() == words[3] for p in pieces)  # never alone: it was held until word 5 resolved it
    assert any(p.strip().startswith(f"{words[3]} {words[4]}") for p in pieces)  # then sent with word 5
    assert chunks[-1].choices[0].finish_reason == ("length" if len(ref.tokens[0]) >= MAX else "stop")


def test_stop_text_rule():
    s = StopText(("red circle", "xyz"))
    assert s.find("a red circle b") == 2 and s.find("a red") is None
    assert s.safe("a red") == 2  # "red" may become "red circle": held
    assert s.safe("a red c") == 2 and s.safe("a red s") == 7
    assert s.safe("ab x") == 3 and s.safe("a red circle b") == 2
    assert token_start("a red", "a red circle") == 6 and token_start("", "a") == 0 and token_start("ab", "abc") == 2


# ---- logprobs ----
def _reference_logprobs(demo, k: int):
    """Greedy decoding in process (runner.prefill + Decoding): per token its id, log-probability, top k."""
    runner = demo.runner
    prep = demo.prepare(image(3), "describe ?")
    out = runner.prefill(prep)
    dec, logits, got = Decoding(runner, out.cache, out.next_pos.clone()), out.logits, []
    stops = set(demo.stop_ids())
    for _ in range(MAX):
        lp = torch.log_softmax(logits[0], -1)
        t = int(lp.argmax())
        if t in stops:
            break
        top = torch.topk(lp, k)
        got.append((demo.tokenizer.decode([t]), float(lp[t]), [demo.tokenizer.decode([i]) for i in top.indices],
                    top.values.tolist()))  # fmt: skip
        logits = dec.step(torch.tensor([t]))
    return got


def _check_logprobs(content, ref):
    assert len(content) == len(ref)
    for e, (tok, lp, top_toks, top_lps) in zip(content, ref, strict=True):
        assert e.token == tok and abs(e.logprob - lp) <= 1e-4 and e.bytes == list(tok.encode())
        assert [x.token for x in e.top_logprobs] == top_toks
        assert all(abs(x.logprob - v) <= 1e-4 for x, v in zip(e.top_logprobs, top_lps, strict=True))


def test_logprobs_plain_and_streamed_equal_the_models(demo, url):
    ref = _reference_logprobs(demo, 3)
    r = ask(url, messages=messages(3), logprobs=True, top_logprobs=3)
    _check_logprobs(r.choices[0].logprobs.content, ref)
    chunks = list(ask(url, messages=messages(3), logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    _check_logprobs(streamed, ref)
    plain = ask(url, messages=messages(3))
    assert plain.choices[0].logprobs is None
    zero = ask(url, messages=messages(3), logprobs=True, top_logprobs=0)
    assert [e.top_logprobs for e in zero.choices[0].logprobs.content] == [[]] * len(ref)


# ---- n ----
def test_n_choices_branch_off_one_prefill_with_the_prompt_kv_shared(demo, monkeypatch):
    """n = 4 at temperature 1: choice i equals the request alone with seed + i; one prefill ran (prefill and
    vision FLOPs equal n = 1's); while the 4 rows decode, their cache reads the prompt's KV as one shared row
    and holds only the generated tokens itself."""
    alone = [demo.generate(image(4), "describe ?", max_new_tokens=MAX, temperature=1.0, seed=7 + i)
             for i in range(4)]  # fmt: skip
    refs = [a.texts[0] for a in alone]
    assert len(set(refs)) > 1  # the seeds differ
    state = ServerState(demo, model_id="demo", caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))
    seen = []
    held = HeldSteps(demo.runner, monkeypatch)

    def look(rows):
        if rows == 4 and not seen:
            cache = next(iter(state.batcher.engine.groups.values())).decoding.cache
            part = cache.prefix.parts[0].layers[0]
            seen.append((part.key.shape[0], part.key.shape[2], cache.layers[0].key.shape[2] if cache.layers else 0))

    held.hold = lambda rows: look(rows)
    calls = RunnerCalls(demo.runner, monkeypatch)
    try:
        with live(state) as (url, _):
            one = ask(url, messages=messages(4), temperature=1.0, seed=7)
            before = calls.prefills
            four = ask(url, messages=messages(4), temperature=1.0, seed=7, n=4)
            assert calls.prefills - before == 1
            streamed = list(ask(url, messages=messages(4), temperature=1.0, seed=7, n=2, stream=True))
    finally:
        calls.close()
    assert [c.message.content for c in four.choices] == refs and [c.index for c in four.choices] == [0, 1, 2, 3]
    assert one.choices[0].message.content == refs[0]
    assert four.usage.prefill_flops == one.usage.prefill_flops > 0
    assert four.usage.vision_flops == one.usage.vision_flops > 0
    prompt = int(demo.prepare(image(4), "describe ?").attention_mask.sum())
    assert seen and seen[0][0] == 1 and seen[0][1] == prompt and seen[0][2] < prompt  # one shared row
    texts = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == refs[:2]
    assert streamed[-1].usage.completion_tokens == sum(len(a.tokens[0]) for a in alone[:2])
    assert four.usage.completion_tokens == sum(len(a.tokens[0]) for a in alone)


# ---- penalties ----
def test_penalties_as_openai_defines_them():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25)
    assert penalize(logits, s, counts).tolist() == [[1.0, 1.0, 2.25, 0.5]]  # 2 - 2*.25 - .5, 3 - .25 - .5
    with pytest.raises(Exception, match="presence_penalty"):
        Sampling(presence_penalty=2.5)


def test_penalties_through_the_server_equal_generate(demo, url):
    kw = {"presence_penalty": -2.0, "frequency_penalty": -1.5}  # (the demo model is too sure for +2 to matter)
    ref = demo.generate(image(3), "describe ?", max_new_tokens=MAX, **kw)
    plain = demo.generate(image(3), "describe ?", max_new_tokens=MAX)
    assert ref.texts[0] != plain.texts[0]  # the penalties change this answer
    r = ask(url, messages=messages(3), **kw)
    assert r.choices[0].message.content == ref.texts[0]
    sampled = demo.generate(image(3), "describe ?", max_new_tokens=MAX, temperature=0.9, seed=2, **kw)
    assert ask(url, messages=messages(3), temperature=0.9, seed=2, **kw).choices[0].message.content == sampled.texts[0]


# ---- conversations ----
def test_system_message_and_follow_up_turns(demo, monkeypatch):
    """A system message and three turns, each equal to vlm.generate on the same conversation; turns 2 and 3
    find their earlier turns in the prefix cache: no whole prefill runs, the reused tokens are in `usage`
    (and OpenAI's `prompt_tokens_details.cached_tokens`), and they prefill fewer FLOPs than the conversation
    prefilled whole."""
    system = Turn("system", "answer the question")
    first = Turn("user", "describe ?", 1)
    state = ServerState(demo, model_id="demo")
    calls = RunnerCalls(demo.runner, monkeypatch)
    sent = [{"role": "system", "content": system.text}, messages(5)[0]]
    turns = [system, first]
    usages = []
    try:
        with live(state) as (url, _):
            for follow in (None, "how many red ?", "is there a blue circle ?"):
                if follow is not None:
                    turns += [Turn("user", follow)]
                    sent += [{"role": "user", "content": follow}]
                before = calls.prefills
                r = ask(url, messages=sent)
                ran = calls.prefills - before
                ref = demo.generate(image(5), Conversation(tuple(turns)), max_new_tokens=MAX)
                assert r.choices[0].message.content == ref.texts[0], turns
                usages.append((r.usage, ran, ref.costs.flops["prefill"]))
                turns += [Turn("assistant", ref.texts[0])]
                sent += [{"role": "assistant", "content": r.choices[0].message.content}]
    finally:
        calls.close()
    (u1, p1, _), (u2, p2, whole2), (u3, p3, whole3) = usages
    assert p1 == 1 and p2 == p3 == 0  # turns 2 and 3: prefilled on top of the stored turns, no whole prefill
    assert u1.prefix_tokens_reused == 0
    assert u2.prefix_tokens_reused == u1.prompt_tokens and u3.prefix_tokens_reused == u2.prompt_tokens
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens
    assert 0 < u2.prefill_flops < whole2 and 0 < u3.prefill_flops < whole3


def test_the_demo_rule_renders_an_earlier_turn_as_the_start_of_the_next(demo):
    a = demo.prepare(image(5), "describe ?")
    conv = Conversation((Turn("user", "describe ?", 1), Turn("assistant", "red circle"), Turn("user", "how many ?")))
    b = demo.prepare(image(5), conv)
    m = a.input_ids.shape[1]
    assert torch.equal(b.input_ids[:, :m], a.input_ids)
    rest = demo.tokenizer.decode(b.input_ids[0, m:])
    assert rest.split() == ["red", "circle", "<|im_end|>", "how", "many", "?", "<ans>"]


def test_data_url_images_in_two_turns_are_counted_in_order(demo, url):
    sent = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(6)}},
                                         {"type": "text", "text": "describe ?"}]},
            {"role": "assistant", "content": "nothing"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(7)}},
                                         {"type": "text", "text": "describe ?"}]}]  # fmt: skip
    conv = Conversation((Turn("user", "describe ?", 1), Turn("assistant", "nothing"), Turn("user", "describe ?", 1)))
    ref = demo.generate([image(6), image(7)], conv, max_new_tokens=MAX)
    assert ask(url, messages=sent).choices[0].message.content == ref.texts[0]


def test_n_stop_and_logprobs_together_in_a_chunked_stream(demo):
    """n = 2 sampled choices, a stop string and logprobs, streamed, on a server that prefills in chunks of 16:
    each choice is its seeded answer alone cut at the stop, its logprobs one per returned token."""
    from trimvlm.serve.limits import ServerLimits

    alone = [demo.generate(image(4), "describe ?", max_new_tokens=MAX, temperature=1.0, seed=5 + i).texts[0]
             for i in range(2)]  # fmt: skip
    stop = alone[0].split()[2]
    want = [t[: t.find(stop)] if stop in t else t for t in alone]
    with live(ServerState(demo, model_id="demo", limits=ServerLimits(max_prefill_tokens=16))) as (url, state):
        chunks = list(ask(url, messages=messages(4), n=2, temperature=1.0, seed=5, stop=stop, logprobs=True,
                          stream=True))  # fmt: skip
    text, entries, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            entries[ch.index] += ch.logprobs.content if ch.logprobs else []
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert [text[0], text[1]] == want and finish[0] == "stop"
    for i in (0, 1):
        assert "".join(e.token + " " for e in entries[i]).strip() == want[i].strip()
    assert chunks[-1].usage.prompt_tokens > 16  # (prefilled in chunks)
