"""README.md and docs/ are reference pages: short README, no development history, commands that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# development history belongs in CHANGELOG.md
HISTORY = re.compile(
    r"\bissues? \d+|\bre-?run|\bidle\b|\bthis session\b|\bsession \d+|\b20\d\d-\d\d-\d\d\b|before / after|"
    r"(before|after) this change|(?-i:REFERENCES\.md)|papers/",  # (docs/references.md is this repository's page)
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


# ---- every repository path the pages name exists; nothing points outside the repository ------------------
SRC = ROOT / "src" / "trimvlm"
TOP = ("src", "tests", "docs", "benchmarks", "constraints", ".ci", ".github")
# a path from the repository root, anywhere on a page (prose, code blocks, backticks)
ROOTED = re.compile(r"(?<![\w/.-])(?:" + "|".join(map(re.escape, TOP)) + r")/[\w./*-]*")
PACKAGES = {p.name for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__"} | {"trimvlm"}
OUTSIDE = re.compile(r"(?<![\w.])(?:\.\./)*shared/|REFERENCES\.md|DESIGN\.md")
# the page's example of a new file (docs/extending.md: "The whole of `src/trimvlm/tokens/NAME.py`:")
TO_CREATE = re.compile(r"The whole of\s+`([^`]+)`:")


def _exists(path: str, base: Path) -> bool:
    """`path` (a `<placeholder>` cut off leaves a prefix; `*` globs) names something under `base`."""
    path = path.rstrip(".,:;")
    if path.endswith(("_", "-")) or "*" in path:
        return any(base.glob(path if "*" in path else path + "*"))
    return (base / path).exists()


def named_paths(page: Path) -> list[tuple[str, bool]]:
    """(path, exists) for every repository path `page` names: paths from the root (src/, tests/, benchmarks/,
    docs/...), package paths in backticks (`serve/engine.py`, `tokens/base.py: TokenReducer`: found under
    src/trimvlm), and relative links (from the page's folder)."""
    text = page.read_text()
    new = set(TO_CREATE.findall(text))
    out = [(p, _exists(p, ROOT)) for p in ROOTED.findall(text) if p.rstrip(".,:;") not in new]
    for span in re.findall(r"`([^`\n]+)`", text):
        for p in re.findall(r"(?<![\w/.-])[\w.-]+/[\w./*-]*", span):
            if p.split("/")[0] in PACKAGES and not p.startswith(TOP):
                bases = [SRC.parent, SRC, *(q for q in SRC.rglob("*") if q.is_dir())]
                out.append((p, any(_exists(p, d) for d in bases)))
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        target = link.split("#")[0]
        if target and not re.match(r"[a-z]+:", target):
            out.append((link, (page.parent / target).exists()))
    return out


def test_every_path_the_docs_name_exists():
    missing = [f"{p.name}: {path}" for p in PAGES for path, ok in named_paths(p) if not ok]
    assert missing == []
    assert sum(len(named_paths(p)) for p in PAGES) > 100  # the pages do name files: the scan finds them


def test_the_path_check_finds_a_missing_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `serve/prefill.py`, src/trimvlm/nothing.py, [a](missing.md), `serve/engine.py`.")
    missing = sorted(path for path, ok in named_paths(page) if not ok)
    assert missing == ["missing.md", "serve/prefill.py", "src/trimvlm/nothing.py"]


def test_no_page_points_outside_the_repository():
    found = [f"{p.name}:{n}: {line.strip()}" for p in PAGES for n, line in enumerate(p.read_text().splitlines(), 1)
             if OUTSIDE.search(line)]  # fmt: skip
    assert found == []
    assert OUTSIDE.search("see ../shared/DESIGN.md") and OUTSIDE.search("REFERENCES.md section 2")


def _anchors(page: Path) -> set[str]:
    """The heading anchors mkdocs gives `page` (python-markdown's toc slugs)."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in heads}


def test_source_docstrings_cite_sections_of_the_references_page():
    """`docs/references.md#anchor` in the source names a heading of that page, every docs page the source names
    exists, and no source cites a file outside the repository."""
    anchors = _anchors(ROOT / "docs" / "references.md")
    cited, pages, outside = set(), set(), []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        cited |= {(path.name, a) for a in re.findall(r"docs/references\.md#([\w-]+)", text)}
        pages |= {(path.name, d) for d in re.findall(r"docs/[\w-]+\.md", text)}
        outside += [path.name] if OUTSIDE.search(text) else []
    assert len(cited) >= 20
    assert [(f, a) for f, a in sorted(cited) if a not in anchors] == []
    assert [(f, d) for f, d in sorted(pages) if not (ROOT / d).exists()] == []
    assert outside == []
