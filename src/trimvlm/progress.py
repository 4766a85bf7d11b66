"""The one progress bar of every long job (eval, benchmark loading, calibration, training): description, bar,
done / total, elapsed time, and a `detail` field (a task's `detail=...`, e.g. the recipe running)."""

from __future__ import annotations


def progress(console=None, enabled: bool = True):
    """A rich `Progress` on `console` (None: rich's default), hidden when not `enabled`."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.text import Text

    class Detail(ProgressColumn):
        def render(self, task) -> Text:
            return Text(str(task.fields.get("detail", "")))

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    Detail(), console=console, disable=not enabled)  # fmt: skip
