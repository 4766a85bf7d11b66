"""README.md and docs/ are reference pages: short README, no development history, commands that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# development history belongs in CHANGELOG.md
HISTORY = re.compile(
    r"\bissues? \d+|\bre-?run|\bidle\b|\bthis session\b|\bsession \d+|\b20\d\d-\d\d-\d\d\b|before / after|"
    r"(before|after) this change|REFERENCES\.md|papers/",
    re.I,
)


def _prose(page: Path) -> list[tuple[int, str]]:
    """Lines of a page, without the results markers (whose results-file names are data)."""
    return [(n, line) for n, line in enumerate(page.read_text().splitlines(), 1) if "<!-- results:" not in line]


def test_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_readme_and_docs_hold_no_development_history():
    found = [f"{p.name}:{n}: {line.strip()}" for p in PAGES for n, line in _prose(p) if HISTORY.search(line)]
    assert found == []


def test_the_history_check_finds_history():
    for line in ("measured in issue 20", "an idle re-run", "Before (0044222, session 8's start)", "on 2026-12-02"):
        assert HISTORY.search(line), line
    assert not HISTORY.search("the decode batch keeps live rows only")


def test_every_trimvlm_command_in_the_docs_exists():
    """`trimvlm NAME` in a code block names a command of the CLI (or an option such as --version)."""
    from typer.main import get_command

    from trimvlm.cli import app

    commands = set(get_command(app).commands)
    used = set()
    for page in PAGES:
        inside = False
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside:
                used |= set(re.findall(r"(?:^|[\s&;(])trimvlm ([a-z][a-z-]*)", line))
    assert used, "no trimvlm command found in the docs"
    assert used - commands == set()


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and [x for x in links if not x.startswith("http") and not (ROOT / x).exists()] == []
