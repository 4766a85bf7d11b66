"""Cost meter: FLOPs equal a hand count and torch's own counter; KV bytes equal the tensors' nbytes."""

import torch

from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image


def hand_count(cfg, batch, q, k, layers):
    d, h, kv, hd, m = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.intermediate_size)  # fmt: skip
    linear = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * m
    per_layer = 2 * batch * q * linear + 4 * batch * h * q * k * hd
    return layers * per_layer


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
    expected = hand_count(cfg, 2, 1, k_len, cfg.num_hidden_layers) + 2 * 2 * cfg.hidden_size * cfg.vocab_size
    assert abs(meter.costs.total_flops - expected) <= 0.01 * expected
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
    lm = hand_count(cfg, 1, s, s, cfg.num_hidden_layers) + 2 * cfg.hidden_size * cfg.vocab_size
    assert abs(meter.costs.flops["prefill"] - lm) <= 0.01 * lm
    nbytes = sum(e.key.nbytes + e.value.nbytes for e in out.cache.layers.values())
    assert out.cache.attention_bytes() == nbytes == meter.costs.kv_bytes
    assert nbytes == cfg.num_hidden_layers * 2 * s * cfg.num_key_value_heads * cfg.head_dim * 4
