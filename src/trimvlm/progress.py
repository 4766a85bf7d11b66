"""The one progress bar of every long job (eval, tune, benchmark loading, calibration, training): description,
bar, done / total, elapsed time, rate, and the current phase (a task's `detail=...` field, e.g. the recipe
running, or what a step is doing).

`progress(console)` is the rich `Progress` itself (tasks added with `add_task(..., detail=...)`); `steps(...)`
is one task on it, advanced with `.advance()` and told its phase with `.phase(text)`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column
from rich.text import Text


class Rate(ProgressColumn):
    """Steps per second since the start, or seconds per step when slower than one a second; the task's `unit`
    field names the step (default "step"), its `done` field the steps done before the start (a resumed run)."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        unit, ran = task.fields.get("unit", "step"), task.completed - task.fields.get("done", 0)
        if ran <= 0 or not elapsed:
            return Text(f"- {unit}/s", style="progress.data.speed")
        per_second = ran / elapsed
        text = f"{_short(per_second)} {unit}/s" if per_second >= 1 else f"{_short(1 / per_second)} s/{unit}"
        return Text(text, style="progress.data.speed")


def _short(x: float) -> str:
    """Two significant digits below 10, whole numbers above: 0.53, 8.2, 41, 4,800."""
    return f"{x:.2g}" if x < 10 else f"{x:,.0f}"


class Phase(ProgressColumn):
    """The task's `detail` field: what it is doing now (the one column that wraps when the line is full)."""

    def __init__(self):
        super().__init__(table_column=Column(overflow="fold"))

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("detail", "")))


def progress(console=None, enabled: bool = True, get_time=None) -> Progress:
    """A rich `Progress` on `console` (None: rich's default), hidden when not `enabled`. `get_time`: the clock
    (default: the console's)."""
    whole = Column(no_wrap=True)
    return Progress(TextColumn("[bold]{task.description}", table_column=whole), BarColumn(BAR, table_column=whole),
                    MofNCompleteColumn(table_column=whole), TimeElapsedColumn(table_column=whole),
                    Rate(table_column=whole), Phase(), console=console, disable=not enabled,
                    get_time=get_time)  # fmt: skip


BAR = 12  # the bar's width: the line keeps room for the phase


@dataclass(frozen=True)
class Steps:
    """One task of a `Progress`: `advance()` a step, `phase(text)` says what it is doing now."""

    bar: Progress
    job: TaskID

    def advance(self, n: int = 1) -> None:
        self.bar.advance(self.job, n)

    def phase(self, text: str) -> None:
        self.bar.update(self.job, detail=text)

    def note(self, line: str) -> None:
        """A line printed above the bar."""
        self.bar.console.print(line, markup=False, highlight=False)


@contextmanager
def steps(description: str, total: int, console=None, enabled: bool = True, phase: str = "",
          unit: str = "step", done: int = 0) -> Iterator[Steps]:  # fmt: skip
    """A progress bar of one task: `total` steps of `unit` (`done` of them already), starting in `phase`. A job
    that fails leaves no bar behind (its error stands alone)."""
    with progress(console, enabled) as bar:
        try:
            yield Steps(bar, bar.add_task(description, total=total, completed=done, detail=phase, unit=unit,
                                          done=done))  # fmt: skip
        except BaseException:
            bar.live.transient = True
            raise
