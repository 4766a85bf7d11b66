"""The terminal output of every command: the console's width, and tables whose columns are declared once.

- In a terminal the text and the tables fit its width (COLUMNS where set). A table shows its default columns,
  and a cell that does not fit its column is folded onto the next line, never cut.
- Piped (not a terminal) and without COLUMNS, the output is laid out as in a `PIPED_WIDTH`-column terminal: text
  wraps and tables fold their cells at that width, so no line is longer than `PIPED_WIDTH`.
- `--wide` adds the columns declared `wide` (the JSON output holds every number), each table at its natural
  width (lines may then pass the terminal's width: `| less -S` reads them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.table import Table

PIPED_WIDTH = 100  # text width of piped output
NATURAL = 100_000  # the width a table is measured in for its natural width


class Terminal(Console):
    """A rich Console that knows whether its tables show their `wide` columns (`wide`) and keep their natural
    width (`whole`: with --wide)."""

    def __init__(self, *, wide: bool = False, **kw):
        sized = "width" in kw or sys.stdout.isatty() or (os.environ.get("COLUMNS") or "").isdigit()
        super().__init__(width=kw.pop("width", None if sized else PIPED_WIDTH), **kw)
        self.wide = wide
        self.whole = wide  # tables at their natural width

    def print(self, *objects, **kw) -> None:
        """rich's print; a table wider than the console is printed at its natural width when `whole`."""
        tables = [o.table if isinstance(o, Sheet) else o for o in objects if isinstance(o, Sheet | Table)]
        natural = (sum(word_and_line_widths(self, t)[1]) + frame(t) for t in tables)  # nothing limiting them
        width = max(natural, default=0) if self.whole else 0
        if width <= self.width:
            return super().print(*objects, **kw)
        kept, self.width = self.width, width
        try:
            super().print(*objects, **kw)
        finally:
            self.width = kept


@dataclass(frozen=True)
class Col:
    """A table column: its heading, right-aligned (numbers), shown with --wide only (`wide`)."""

    name: str
    right: bool = False
    wide: bool = False


class Sheet:
    """A rich Table of declared columns: the `wide` ones are left out unless the console is wide. Rows and
    sections are given for every declared column. Rendered, it takes its natural width where that fits, else
    it narrows the columns with the most room to spare (a heading or cell wraps between words) before any word
    is folded."""

    def __init__(self, console, title: str | None, cols: Sequence[Col | str], **kw):
        cols = [c if isinstance(c, Col) else Col(c) for c in cols]
        wide = getattr(console, "wide", False)
        self.keep = [wide or not c.wide for c in cols]
        self.table = Table(title=title, title_justify="left", **kw)
        for c, keep in zip(cols, self.keep, strict=True):
            if keep:
                self.table.add_column(c.name, justify="right" if c.right else "left", overflow="fold")

    def row(self, *cells, style: str | None = None) -> None:
        self.table.add_row(*(c for c, keep in zip(cells, self.keep, strict=True) if keep), style=style)

    def section(self) -> None:
        self.table.add_section()

    def __rich_console__(self, console: Console, options: ConsoleOptions):
        widths = column_widths(console, self.table, options.max_width)
        for column, width in zip(self.table.columns, widths, strict=True):
            column.width = width
        yield self.table


def column_widths(console: Console, table: Table, width: int) -> list[int]:
    """Content widths of `table`'s columns within `width` columns: each column's natural width, the one with the
    most room above its longest word narrowed first, one character at a time."""
    low, high = word_and_line_widths(console, table)
    excess = sum(high) + frame(table) - width
    while excess > 0 and any(h > lo for h, lo in zip(high, low, strict=True)):
        k = max(range(len(high)), key=lambda i: high[i] - low[i])
        high[k] -= 1
        excess -= 1
    return high


def word_and_line_widths(console: Console, table: Table) -> tuple[list[int], list[int]]:
    """Per column, its longest word and its longest line (heading and cells)."""
    options = console.options.update_width(NATURAL)
    low, high = [], []
    for column in table.columns:
        sizes = [Measurement.get(console, options, console.render_str(c) if isinstance(c, str) else c)
                 for c in [column.header, *column.cells]]  # fmt: skip
        low.append(max(m.minimum for m in sizes))
        high.append(max(m.maximum for m in sizes))
    return low, high


def frame(table: Table) -> int:
    """The characters of `table`'s rows that are not cell content: padding and borders."""
    n = len(table.columns)
    return n * (table.padding[1] + table.padding[3]) + (n + 1 if table.box else 0)


def fits(console: Console, sheet: Sheet) -> bool:
    """Whether `sheet` shows whole on `console`: at its natural width, or with each word of its cells whole
    within the console's width."""
    if getattr(console, "whole", False):
        return True
    return sum(word_and_line_widths(console, sheet.table)[0]) + frame(sheet.table) <= console.width
