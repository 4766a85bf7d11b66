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

from dataclasses import dataclass, field

from trimvlm.scoring.trie import Forest

ALPHA = 1 / 16  # cost of one gathered ancestor entry, in token slots
MIN_SHARED = 1.02  # below this logical / unique ratio the candidates run as plain rows (no planning)
# An extra kernel call (the ancestor part of an attention layer, one more recurrent call) costs about as much
# as this many token slots of a layer on the tiny CPU models of benchmarks/scoring_scan.py (~0.7 ms per layer
# against ~15 us per token): a layout that saves fewer slots runs as plain rows.
CALL_COST = 64


@dataclass
class Piece:
    nodes: list[int]
    parent: int  # piece id whose last node precedes this piece's first node, -1 at the prefix
    request: int
    level: int = 0
    children: list[int] = field(default_factory=list)


def _pieces(n: int, w: int) -> int:
    return -(-n // w)


def row_cost(lengths: list[int], depth0: list[int], w: int) -> float:
    """Padded slots + ALPHA x gathered ancestors of rows (length, depth of first node) cut at width w."""
    cost = 0.0
    for n, a in zip(lengths, depth0, strict=True):
        k = _pieces(n, w)
        cost += k * w + ALPHA * (k * a + w * k * (k - 1) / 2)
    return cost


@dataclass
class LayerMix:
    """What the layout's cost is summed over: executed attention and recurrent layers, and the granularity of
    the recurrent kernel (rows are padded to multiples of `chunk` tokens; 1 for a per-token kernel)."""

    attention: int = 1
    recurrent: int = 0
    chunk: int = 1


def plan_pieces(f: Forest, mix: LayerMix | None = None) -> list[Piece]:
    """The cheapest layout over the candidate widths (every chain length and every candidate's path length):
    for each width, absorb greedily, then cost the rows cut at that width; plain rows (one per candidate, the
    `batched` layout) when they cost less over the executed layers once every extra call is counted."""
    mix = mix or LayerMix()
    plain = [Piece(list(p), -1, r) for r, req in enumerate(f.paths) for p in req]
    saved = f.logical_tokens - f.num_nodes  # the most any merged layout can save per layer
    if f.logical_tokens < MIN_SHARED * f.num_nodes or saved <= CALL_COST:
        return plain
    merged = merged_layout(f)
    return plain if layout_cost(plain, f, mix) <= layout_cost(merged, f, mix) else merged


def layout_cost(pieces: list[Piece], f: Forest, mix: LayerMix) -> float:
    """Token slots (plus CALL_COST per extra kernel call) of one pass of the layout: an attention layer runs
    the padded [rows, width] layout once, gathers the ancestors, and makes one more call when there are any; a
    recurrent layer runs each level's rows (leaves in one call, rows with children one call per length), each
    row padded to its call's length rounded up to the kernel's chunk."""
    w = max_len(pieces)
    ancestors = [f.depth[p.nodes[0]] for p in pieces]
    attention = len(pieces) * w + ALPHA * sum(ancestors) + CALL_COST * any(a > 0 for a in ancestors)
    calls: dict[tuple, list[int]] = {}
    for p in pieces:
        key = (p.level, len(p.nodes) if p.children else 0)
        calls.setdefault(key, []).append(len(p.nodes))
    recurrent = sum(len(n) * (-(-max(n) // mix.chunk) * mix.chunk) + CALL_COST for n in calls.values())
    return mix.attention * attention + mix.recurrent * (recurrent - CALL_COST)


def max_len(pieces: list[Piece]) -> int:
    return max(len(p.nodes) for p in pieces)


def merged_layout(f: Forest) -> list[Piece]:
    """The trie layout: absorbed and cut at the best width (never plain rows)."""
    widths = {len(c.nodes) for c in f.chains} | {len(p) for req in f.paths for p in req}
    best = None
    for w in sorted(widths, reverse=True):
        rows, kept = _absorb(f, w)
        cost = row_cost([len(rows[r].nodes) for r in kept], [f.depth[rows[r].nodes[0]] for r in kept], w)
        if best is None or cost < best[0]:
            best = (cost, w, rows, kept)
    _, w, rows, kept = best
    return _cut(rows, kept, w)


def _absorb(f: Forest, w: int) -> tuple[list[Piece], list[int]]:
    """Chains as rows; absorb a chain into its children wherever that lowers the cost at width w (cheapest
    duplications first). Returns the rows and the ids of those kept."""
    rows = [Piece(list(c.nodes), c.parent, c.request, children=list(c.children)) for c in f.chains]
    alive = [True] * len(rows)
    order = sorted(
        (r for r, p in enumerate(rows) if p.children),
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
