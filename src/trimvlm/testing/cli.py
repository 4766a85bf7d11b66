"""Driving the `trimvlm` command in tests: run it in-process, and check that bad input is one error line."""

from __future__ import annotations


def run_cli(*args):
    """The `trimvlm` app invoked with `args` (each turned into a string); typer's Result."""
    from typer.testing import CliRunner

    from trimvlm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line_error(res, message: str) -> None:
    """Exit status 2, no traceback, exactly one `error: ...` line containing `message` (whitespace-folded:
    the console may wrap a long line)."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in " ".join(lines[0].split()), lines[0]
