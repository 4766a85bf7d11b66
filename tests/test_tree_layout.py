"""The `tree` executor's layout and cost model: recurrent rows join cut pieces, short pieces stay at
their own length, absorption is costed over the executed layers, a merge is taken only past the margin."""

from trimvlm.scoring.executors.tree_layout import (
    MARGIN,
    SAVING_OVER_CALLS,
    LayerMix,
    Piece,
    layout_cost,
    layout_price,
    merged_floor,
    merged_layout,
    plan_pieces,
    recurrent_rows,
)
from trimvlm.scoring.executors.tree_schedule import schedule
from trimvlm.scoring.trie import build_forest


def _forest(root: int, children: int, length: int, groups: int = 0, group_len: int = 0):
    """One request: a shared run of `root` tokens, then (optionally) `groups` group runs of `group_len`, then
    `children` candidates of `length` own tokens (the first one tells them apart)."""
    cands = []
    for i in range(children):
        toks = [1] * root
        if groups:
            toks += [100 + i % groups] + [2] * (group_len - 1)
        cands.append(toks + [200 + i] + [3] * (length - 1))
    return build_forest([cands], [10], merge=True)


def _lengths(pieces, rows, level=None):
    return [sum(len(pieces[i].nodes) for i in ids) for ids, lv in rows if level is None or lv == level]


def test_recurrent_rows_join_cut_pieces():
    f = _forest(root=96, children=8, length=33)
    chunked = LayerMix(attention=1, recurrent=3, chunk=64)
    pieces = merged_layout(f, LayerMix(attention=4))  # width 33: the root is cut into three pieces
    assert max(len(p.nodes) for p in pieces) == 33 and len(pieces) == 3 + 8
    rows = recurrent_rows(pieces, chunked)
    assert _lengths(pieces, rows, 0) == [96]  # one row of 96 (padded to 128), not 3 calls padded to 64 each
    assert sorted(lv for _, lv in rows) == [0] + [1] * 8
    sched = schedule(pieces, list(range(len(pieces))), mix=chunked)
    assert len(sched.calls) == 2  # the root (its final state kept), then all leaves in one call
    assert sched.calls[0].keep and not sched.calls[1].keep
    assert sched.tokens_run == 96 + 8 * 33


def test_short_pieces_stay_at_their_own_length():
    """With a recurrent form for rows of <= 24 tokens, the 17 + 16 token pieces of 64 leaves stay two short
    calls (joined they would pad to 64 each), while the root's pieces (one row per level) are joined."""
    f = _forest(root=96, children=64, length=33)
    short = LayerMix(attention=1, recurrent=3, chunk=64, short=24, call_cost=99.0)
    pieces = merged_layout(f, short)
    assert max(len(p.nodes) for p in pieces) <= 24
    rows = recurrent_rows(pieces, short)
    assert _lengths(pieces, rows, 0) == [96]
    leaves = [ids for ids, _ in rows if not pieces[ids[-1]].children]
    assert len(leaves) == 64 and all(len(ids) == 1 and len(pieces[ids[0]].nodes) <= 24 for ids in leaves)
    assert len(rows) == 1 + 2 * 64


def test_short_recurrent_kernel_changes_the_width():
    """With a recurrent form for rows of <= 24 tokens, the cheapest layout cuts everything to <= 24 tokens (no
    padding to the 64-token chunk); without it, the chain widths."""
    f = _forest(root=96, children=16, length=33)
    chunked = LayerMix(attention=1, recurrent=3, chunk=64, call_cost=99.0)
    short = LayerMix(attention=1, recurrent=3, chunk=64, short=24, call_cost=99.0)
    assert max(len(p.nodes) for p in merged_layout(f, chunked)) == 33
    cut = merged_layout(f, short)
    assert max(len(p.nodes) for p in cut) <= 24
    assert layout_cost(cut, f, short) < layout_cost(merged_layout(f, chunked), f, short)


def test_absorption_costed_over_the_executed_layers():
    """A 2-token fork with four 63-token children: attention layers absorb it (one row fewer at width 65),
    recurrent layers with 64-token chunks must not (every 65-token row would pad to 128)."""
    f = _forest(root=2, children=4, length=63)
    attention = merged_layout(f, LayerMix(attention=4))
    assert all(p.parent < 0 for p in attention) and len(attention) == 4  # absorbed: four plain rows of 65
    recurrent = LayerMix(attention=0, recurrent=4, chunk=64)
    kept = merged_layout(f, recurrent)
    assert any(p.children for p in kept)  # the fork keeps its own row
    assert layout_cost(kept, f, recurrent) < layout_cost(attention, f, recurrent)


def test_merge_taken_only_past_the_margin():
    f = _forest(root=16, children=8, length=16)
    plain = [Piece(list(p), -1, 0) for p in f.paths[0]]
    took = {}
    for call_cost in (0.0, 64.0, 200.0, 400.0, 1000.0):
        mix = LayerMix(attention=4, call_cost=call_cost)
        merged = merged_layout(f, mix)
        if any(p.parent >= 0 for p in merged):  # (the floor holds for layouts with ancestors)
            assert merged_floor(f, mix) <= layout_cost(merged, f, mix)
        took[call_cost] = any(p.parent >= 0 for p in plan_pieces(f, mix))
        slots, calls = layout_price(merged, f, mix)
        pays = layout_price(plain, f, mix)[0] - slots >= SAVING_OVER_CALLS * call_cost * calls
        cheaper = layout_cost(merged, f, mix) <= (1 - MARGIN) * layout_cost(plain, f, mix)
        assert took[call_cost] == (pays and cheaper)
    assert took[0.0] and not took[1000.0]


def test_call_cost_measured_once_per_model_and_threads(vlms, monkeypatch):
    """The call cost is measured on the model at the first merged scoring (not a constant), then cached per
    model, device, thread count and skip set; scores stay those of `independent`."""
    import torch

    from trimvlm.scoring.executors import call_cost
    from trimvlm.testing import WORDS, random_image

    vlm = vlms("qwen3_vl")
    model = vlm.adapter.model
    call_cost._CACHE.pop(model, None)
    calls = []
    real = call_cost.measure
    monkeypatch.setattr(call_cost, "measure", lambda w, m: calls.append(1) or real(w, m))
    shared = " ".join(WORDS[20:32])
    cands = [f"{shared} {w}" for w in WORDS[32:40]]
    ref = vlm.score(random_image(1), "what is the colour", cands, executor="independent")
    for _ in range(2):
        got = vlm.score(random_image(1), "what is the colour", cands, executor="tree")
        assert max(abs(a - b) for a, b in zip(ref[0].logits, got[0].logits, strict=True)) <= 1e-4
    assert len(calls) == 1
    ((key, cost),) = call_cost.measured(model).items()
    assert key == ("cpu", torch.get_num_threads(), frozenset())
    assert 0.0 <= cost <= call_cost.MAX_CALL_COST
    vlm.score(
        random_image(1), "what is the colour", cands[:2], executor="tree"
    )  # no sharing: nothing to cost
    assert len(calls) == 1
