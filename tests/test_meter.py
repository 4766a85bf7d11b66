"""Cost meter: FLOPs equal a hand count and torch's own counter; KV bytes equal the tensors' nbytes."""

import torch
from conftest import hand_flops

from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image


def test_decode_step_flops_match_hand_count_and_torch_counter(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    prep = adapter.prepare(
        [[random_image(1)], [random_image(2, (96, 64))]], ["what is the colour", "how many"]
    )
    out = runner.prefill(prep)
    k_len = out.cache.length(0) + 1
    meter = Meter()
    with flop_counter() as fc:
        runner.step(torch.tensor([[5], [6]]), adapter.text_positions(out.next_pos, 1), out.cache, meter=meter)
    cfg = adapter.text_config
    expected = hand_flops(cfg, 2, 1, k_len, cfg.num_hidden_layers) + 2 * 2 * cfg.hidden_size * cfg.vocab_size
    assert meter.costs.total_flops == expected
    assert meter.costs.total_flops == fc.get_total_flops()


def test_prefill_flops_equal_torch_counter_and_kv_bytes_equal_nbytes(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    prep = adapter.prepare([[random_image(3)]], ["describe the image"])
    meter = Meter()
    runner = Runner(adapter)
    runner.vision_flops(prep)  # counted once per input shape, outside the measured run
    with flop_counter() as fc:
        out = runner.prefill(prep, meter=meter)
    assert meter.costs.total_flops == fc.get_total_flops()
    s = prep.input_ids.shape[1]
    cfg = adapter.text_config
    # prefill: S queries over S keys in every layer (the mask hides the future; the kernel still runs it)
    lm = hand_flops(cfg, 1, s, s, cfg.num_hidden_layers) + 2 * cfg.hidden_size * cfg.vocab_size
    assert meter.costs.flops["prefill"] == lm
    nbytes = sum(e.key.nbytes + e.value.nbytes for e in out.cache.layers.values())
    assert out.cache.attention_bytes() == nbytes == meter.costs.kv_bytes
    assert nbytes == cfg.num_hidden_layers * 2 * s * cfg.num_key_value_heads * cfg.head_dim * 4


def test_a_finished_sample_leaves_the_batch(tiny_adapter):
    """Decode costs follow the live rows: a batch where one sample stops at its first token costs what the
    two samples cost alone, and its tokens are those of the samples alone."""
    from trimvlm.runtime.generate import generate

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    imgs = [[random_image(11)], [random_image(12)]]
    prompts = ["what is the colour", "what is the shape"]  # the same length: no padding in the batch
    prep = adapter.prepare(imgs, prompts)
    free = generate(runner, prep, max_new_tokens=6, stop_ids=[], pad_id=0)
    first = free.tokens[:, 0].tolist()
    assert first[0] != first[1] and first[0] not in free.tokens[1].tolist(), "pick other images"
    stop = [first[0]]
    both = generate(runner, prep, max_new_tokens=6, stop_ids=stop, pad_id=0)
    alone = [generate(runner, adapter.prepare([im], [p]), max_new_tokens=6, stop_ids=stop, pad_id=0)
             for im, p in zip(imgs, prompts, strict=True)]  # fmt: skip
    assert both.lengths.tolist() == [1, 6]
    assert both.tokens[1].tolist() == alone[1].tokens[0].tolist()
    assert both.costs.decode_flops == sum(a.costs.decode_flops for a in alone)
    assert both.costs.decode_flops < free.costs.decode_flops


def test_cpu_peak_memory_is_measured_on_tensors(tiny_adapter):
    """With the tensor tracker the peak of a prefill holds at least its KV cache, and falls when tokens are
    dropped; untracked CPU runs say the peak was not measured instead of reporting 0."""
    from trimvlm.plan import make_plan
    from trimvlm.runtime.generate import generate

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    prep = adapter.prepare([[random_image(3, (128, 128))]], ["describe the image"])
    peaks = {}
    for recipe in ("", "tokens=random:keep=0.25:layer=0"):
        plan = make_plan(recipe, runner)
        out = generate(runner, prep, plan, max_new_tokens=2, stop_ids=[], pad_id=0, meter=Meter(track_tensors=True))
        c = out.costs
        assert c.peak_memory_kind == "tensor_peak_over_start"
        assert c.peak_memory_bytes >= c.kv_bytes > 0
        peaks[recipe] = c.peak_memory_bytes
    assert peaks["tokens=random:keep=0.25:layer=0"] < peaks[""]
    plain = generate(runner, prep, max_new_tokens=1, stop_ids=[], pad_id=0).costs
    assert plain.peak_memory_kind == "not_measured"
    reported = plain.as_dict()
    assert reported["peak_memory_kind"] == "not_measured" and reported["peak_memory_bytes"] is None  # never a 0


def test_vision_flops_are_counted_once_per_input_shape_and_bounded(tiny_adapter):
    """The vision-FLOP count is keyed on pixel shapes and grids (not the prompts), and the memo is bounded; a
    prefill of a shape it does not remember counts its own encode (the vision tower never runs twice)."""
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    img = random_image(1, (64, 64))
    a = adapter.prepare([[img]], ["what is the colour"])
    b = adapter.prepare([[random_image(2, (64, 64))]], ["how many shapes are there in this picture"])
    fa = runner.vision_flops(a)
    assert fa > 0 and runner.vision_flops(b) == fa and len(runner.flops) == 1
    runner.flops.max_bytes = 2  # shapes remembered
    for side in (96, 128, 160):
        runner.vision_flops(adapter.prepare([[random_image(3, (side, 64))]], ["x"]))
    assert len(runner.flops) == 2
    meter = Meter()
    with flop_counter() as fc:
        runner.prefill(a, meter=meter)  # a miss again (evicted): counted on the prefill's own encode
    assert meter.costs.flops["vision"] == fa
    assert fc.get_total_flops() == meter.costs.total_flops  # nothing ran besides the prefill itself
    assert runner.vision_flops(a) == fa and len(runner.flops) == 2  # and it is remembered again
