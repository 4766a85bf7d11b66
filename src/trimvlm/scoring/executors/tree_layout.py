"""The row layout of the `tree` executor: which nodes go in which row of the [rows, width] chunk.

Start from the trie's chains (one row each). Two costs pull against each other: every row is padded to the
common width W, and every row gathers the keys of all its ancestors (ALPHA per entry: a copy of one key and
value per layer, far cheaper than running a token). So
- a short shared chain with few children is *absorbed* into its children (its nodes are run again at the start
  of each child's row: exact, the same history at the same positions) when that costs fewer padded slots than
  giving it a row of its own — e.g. a one-token fork that random first words create would otherwise take a
  whole padded row;
- rows longer than W are cut into pieces (a long shared run next to short leaves would otherwise pad every
  leaf row to its length);
- W is the candidate width (a chain or path length) whose absorbed and cut layout costs least.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from trimvlm.scoring.trie import Forest

ALPHA = 1 / 16  # cost of one gathered ancestor entry, in token slots
MIN_SHARED = 1.02  # below this logical / unique ratio the candidates run as plain rows (no planning)
# What an extra kernel call (the ancestor part of an attention layer, one more recurrent call) costs, in token
# slots of a layer. The executor measures it on the model at first use (`executors/call_cost.py`); this is
# the default when nothing is measured (~0.7 ms per layer against ~15 us per token on the tiny CPU models).
CALL_COST = 64
# A merged layout is taken only when it is predicted to cost at most (1 - MARGIN) x the plain rows, calls
# included: a merge that saves less than that is within the model's error and may not pay (on the scan's
# 8-token suffixes, merges predicted at 0.87-0.93x of plain ran 1.07-1.13x slower than `batched`).
MARGIN = 0.15
# ... and only when the slots it saves pay for its extra calls SAVING_OVER_CALLS times over: the overhead of
# the tree's calls grows with its rows beyond what the call cost measures (16 x 8-token suffixes of a
# 6-token shared run, saving 2x their calls' price, ran 1.08-1.11x slower than `batched` on Qwen3.5).
SAVING_OVER_CALLS = 3


@dataclass
class Piece:
    nodes: list[int]
    parent: int  # piece id whose last node precedes this piece's first node, -1 at the prefix
    request: int
    level: int = 0
    children: list[int] = field(default_factory=list)


def _pieces(n: int, w: int) -> int:
    return -(-n // w)


def row_cost(lengths: list[int], depth0: list[int], w: int, pad: int | None = None) -> float:
    """Padded slots + ALPHA x gathered ancestors of rows (length, depth of first node) cut at width w, each
    piece padded to `pad` (default w; the longest piece's length makes it the attention layer's exact price)."""
    cost, pad = 0.0, w if pad is None else pad
    for n, a in zip(lengths, depth0, strict=True):
        k = _pieces(n, w)
        cost += k * pad + ALPHA * (k * a + w * k * (k - 1) / 2)
    return cost


@dataclass
class LayerMix:
    """What the layout's cost is summed over: executed attention and recurrent layers, and the granularity of
    the recurrent kernel (rows are padded to multiples of `chunk` tokens; 1 for a per-token kernel)."""

    attention: int = 1
    recurrent: int = 0
    chunk: int = 1
    short: int = 0  # recurrent calls of at most this many tokens run at their own length (no chunk padding)
    call_cost: float = CALL_COST  # token slots one extra kernel call costs (measured: executors/call_cost.py)

    def padded(self, n: int) -> int:
        """The slots a recurrent call of n tokens per row runs per row."""
        return n if n <= self.short else -(-n // self.chunk) * self.chunk


class Price(NamedTuple):
    """One pass of a layout over the executed layers: its token slots and its kernel calls beyond the one a
    plain layer makes."""

    slots: float
    calls: float


class RecurrentRow(NamedTuple):
    """A row a recurrent layer runs: its pieces in order and its level (the rows above it)."""

    ids: list[int]
    level: int


class _Width(NamedTuple):
    cost: float  # padded slots (`row_cost`)
    width: int
    rows: list[Piece]
    kept: list[int]


class _Option(NamedTuple):
    floor: float  # a lower bound of its layout_cost (`_floor`)
    order: int
    rows: list[Piece]
    kept: list[int]
    width: int


class _Best(NamedTuple):
    cost: float
    order: int
    pieces: list[Piece]


def plan_pieces(f: Forest, mix: LayerMix | None = None) -> list[Piece]:
    """The cheapest layout over the executed layers: plain rows (one per candidate, the `batched` layout), or
    the trie's merged layout (`merged_layout`) when it is predicted to cost at most (1 - MARGIN) x the plain
    rows once every extra kernel call is counted, and the slots it saves are at least SAVING_OVER_CALLS x the
    price of its extra calls."""
    mix = mix or LayerMix()
    plain = [Piece(list(p), -1, r) for r, req in enumerate(f.paths) for p in req]
    saved = f.logical_tokens - f.num_nodes  # the most any merged layout can save per layer
    if not worth_planning(f) or saved <= mix.call_cost:
        return plain
    limit = (1 - MARGIN) * layout_cost(plain, f, mix)
    if merged_floor(f, mix) > limit:  # no merged layout can pay: skip planning one
        return plain
    merged = merged_layout(f, mix, limit)
    if merged is None:  # no merged layout can cost <= limit: none was built
        return plain
    price = layout_price(merged, f, mix)
    saving = layout_price(plain, f, mix).slots - price.slots
    pays = saving >= SAVING_OVER_CALLS * mix.call_cost * price.calls
    return merged if pays and price.slots + mix.call_cost * price.calls <= limit else plain


def merged_floor(f: Forest, mix: LayerMix) -> float:
    """A lower bound of `layout_cost` for any merged layout that has ancestors: every unique node once per
    layer; in a recurrent layer at least the unique nodes and at least each leaf chain's own row padded to the
    kernel's chunk (leaf rows are disjoint); one extra call per layer."""
    leaves = sum(mix.padded(len(c.nodes)) for c in f.chains if not c.children)
    slots = mix.attention * f.num_nodes + mix.recurrent * max(f.num_nodes, leaves)
    return slots + mix.call_cost * (mix.attention + mix.recurrent)


def worth_planning(f: Forest) -> bool:
    """Whether the trie merges enough (logical / unique >= MIN_SHARED) for a merged layout to be costed."""
    return f.logical_tokens >= MIN_SHARED * f.num_nodes


def layout_cost(pieces: list[Piece], f: Forest, mix: LayerMix) -> float:
    """Token slots of one pass of the layout, plus `mix.call_cost` per kernel call beyond the one a plain
    layer makes (`layout_price`)."""
    price = layout_price(pieces, f, mix)
    return price.slots + mix.call_cost * price.calls


def layout_price(pieces: list[Piece], f: Forest, mix: LayerMix) -> Price:
    """The token slots and extra kernel calls of one pass of the layout over the executed layers. An attention
    layer runs the padded [rows, width] layout once, gathers the ancestors, and makes one more call when there
    are any. A recurrent layer runs the recurrent rows (`recurrent_rows`: pieces joined along single-child
    links) level by level, the leaves in one call and rows with children one call per length, each row padded
    to its call's length rounded up to the kernel's chunk; plain rows (no parents) make one call per length,
    as the runner groups rows by their count of valid tokens."""
    w = max(len(p.nodes) for p in pieces)
    ancestors = [f.depth[p.nodes[0]] for p in pieces]
    tree = any(a > 0 for a in ancestors)
    att_slots, att_calls = len(pieces) * w + ALPHA * sum(ancestors), float(tree)
    calls: dict[tuple, list[int]] = {}
    if not mix.recurrent:  # attention only: no recurrent rows to price
        calls[()] = []
    elif tree or w <= mix.short:  # (short plain rows: one call, whatever their lengths)
        for row in recurrent_rows(pieces, mix):
            n = sum(len(pieces[p].nodes) for p in row.ids)
            calls.setdefault((row.level, n if pieces[row.ids[-1]].children else 0), []).append(n)
    else:
        for p in pieces:
            calls.setdefault((0, len(p.nodes)), []).append(len(p.nodes))
    rec_slots = sum(len(n) * mix.padded(max(n)) for n in calls.values() if n)
    return Price(
        slots=mix.attention * att_slots + mix.recurrent * rec_slots,
        calls=mix.attention * att_calls + mix.recurrent * (len(calls) - 1),
    )


def recurrent_rows(pieces: list[Piece], mix: LayerMix | None = None) -> list[RecurrentRow]:
    """The rows a recurrent layer runs, parents' rows before their children's. A
    piece with exactly one child may continue into it (the same recurrence, nothing else starts from the state
    in between): it does unless the joined row would pay more padding (`LayerMix.padded`: a row past `short`
    tokens pads to the chunk) than the call it saves, shared by the pieces of the child's level. A row ends at
    a fork or a leaf; its level counts the rows above it."""
    mix = mix or LayerMix()
    per_level = Counter(piece.level for piece in pieces)
    out: list[RecurrentRow] = []
    todo = [(p, 0) for p, piece in enumerate(pieces) if piece.parent < 0]
    while todo:
        nxt = []
        for p, level in todo:
            ids, n = [p], len(pieces[p].nodes)
            while len(pieces[ids[-1]].children) == 1:
                c = pieces[ids[-1]].children[0]
                m = len(pieces[c].nodes)
                share = mix.call_cost / per_level[pieces[c].level]
                if mix.padded(n + m) > mix.padded(n) + mix.padded(m) + share:
                    break
                ids.append(c)
                n += m
            out.append(RecurrentRow(ids, level))
            nxt += [(c, level + 1) for c in pieces[ids[-1]].children]
        todo = nxt
    return out


WIDTHS = 3  # widths whose layouts are costed over the executed layers (the best by padded slots)


def merged_layout(f: Forest, mix: LayerMix | None = None, limit: float | None = None) -> list[Piece] | None:
    """The trie layout (never plain rows): at every candidate width (each chain length and each candidate's
    path length; with a short recurrent form, widths it runs at their own length), the chains absorbed greedily
    (`_absorb`) and cut at that width; the WIDTHS best by padded slots (and the WIDTHS best of the short
    widths) are then costed over the executed layers (`layout_cost`) with and without absorption — an absorbed
    chain runs again in every child in every layer, which a recurrent layer may pay more for than the row it
    saves — and the cheapest is taken. Options are cut and costed cheapest bound first (`_floor`), only while
    their bound can beat the best so far; None, with nothing cut, when no bound is <= `limit`."""
    mix = mix or LayerMix()
    widths = {len(c.nodes) for c in f.chains} | {len(p) for req in f.paths for p in req}
    if mix.recurrent and mix.short:  # widths whose pieces the recurrent kernel runs at their own length
        widths |= {mix.short} | {-(-n // k) for n in widths for k in (2, 3) if n > mix.short}
        widths = {w for w in widths if w > 0}
    ranked = []
    for w in sorted(widths, reverse=True):
        rows, kept = _absorb(f, w)
        cost = row_cost([len(rows[r].nodes) for r in kept], [f.depth[rows[r].nodes[0]] for r in kept], w)
        ranked.append(_Width(cost, w, rows, kept))
    ranked.sort(key=lambda t: (t.cost, -t.width))
    short = [t for t in ranked if t.width <= mix.short] if mix.recurrent else []
    options: list[_Option] = []
    for t in ranked[:WIDTHS] + short[:WIDTHS]:
        options.append(_Option(_floor(f, t.rows, t.kept, t.width, mix), len(options), t.rows, t.kept, t.width))
        if len(t.kept) < len(f.chains):  # something was absorbed: the same width without absorbing
            rows, kept = _absorb(f, t.width, absorb=False)
            options.append(_Option(_floor(f, rows, kept, t.width, mix), len(options), rows, kept, t.width))
    if limit is not None and min(o.floor for o in options) > limit:
        return None
    best = None  # the cheapest, the first in order among equals
    for o in sorted(options, key=lambda o: (o.floor, o.order)):
        if best is not None and o.floor > best.cost:  # this one and all after it cost more than the best
            break
        pieces = _cut(o.rows, o.kept, o.width)
        cost = layout_cost(pieces, f, mix)
        if best is None or (cost, o.order) < (best.cost, best.order):
            best = _Best(cost, o.order, pieces)
    return best.pieces


def _floor(f: Forest, rows: list[Piece], kept: list[int], w: int, mix: LayerMix) -> float:
    """A lower bound of `layout_cost` of the kept rows cut at width w, without cutting them: the attention
    layers' price exactly (`row_cost`, pieces padded to the longest), every recurrent layer at least each row's
    nodes once, and when a piece will have ancestors (a row off another, or one cut) the one extra call of
    every layer (an attention layer's ancestors; a recurrent layer's second level)."""
    lengths = [len(rows[r].nodes) for r in kept]
    depth0 = [f.depth[rows[r].nodes[0]] for r in kept]
    att = row_cost(lengths, depth0, w, pad=min(w, max(lengths)))
    tree = any(a > 0 for a in depth0) or max(lengths) > w
    return (
        mix.attention * att
        + mix.recurrent * sum(lengths)
        + tree * mix.call_cost * (mix.attention + mix.recurrent)
    )


def _absorb(f: Forest, w: int, absorb: bool = True) -> tuple[list[Piece], list[int]]:
    """Chains as rows; absorb a chain into its children wherever that lowers the cost at width w (cheapest
    duplications first; none with absorb=False). Returns the rows and the ids of those kept."""
    rows = [Piece(list(c.nodes), c.parent, c.request, children=list(c.children)) for c in f.chains]
    alive = [True] * len(rows)
    order = sorted(
        (r for r, p in enumerate(rows) if p.children and absorb),
        key=lambda r: len(rows[r].nodes) * len(rows[r].children),
    )
    for r in order:
        p = rows[r]
        n = len(p.nodes)
        a = f.depth[p.nodes[0]]
        grow = sum(_pieces(len(rows[c].nodes) + n, w) - _pieces(len(rows[c].nodes), w) for c in p.children)
        delta = w * (grow - _pieces(n, w)) - ALPHA * (len(p.children) * n + _pieces(n, w) * a)
        if delta >= 0:
            continue
        for c in p.children:
            rows[c].nodes = p.nodes + rows[c].nodes
            rows[c].parent = p.parent
        if p.parent >= 0:
            siblings = rows[p.parent].children
            k = siblings.index(r)
            siblings[k : k + 1] = p.children
        alive[r] = False
    return rows, [r for r in range(len(rows)) if alive[r]]


def _cut(rows: list[Piece], kept: list[int], w: int) -> list[Piece]:
    """Cut every kept row into pieces of at most w nodes, parents before children, levels set."""
    out: list[Piece] = []
    last_piece: dict[int, int] = {}  # row id -> id of its last piece
    todo = [r for r in kept if rows[r].parent < 0]
    while todo:
        nxt = []
        for r in todo:
            row = rows[r]
            parent = last_piece[row.parent] if row.parent >= 0 else -1
            for a in range(0, len(row.nodes), w):
                level = out[parent].level + 1 if parent >= 0 else 0
                out.append(Piece(row.nodes[a : a + w], parent, row.request, level))
                if parent >= 0:
                    out[parent].children.append(len(out) - 1)
                parent = len(out) - 1
            last_piece[r] = parent
            nxt += row.children
        todo = nxt
    return out
