"""The built documentation site, opened in headless Chromium (.ci/site_images.py): every image of every page
loads, the figures `make results` draws included. Skipped where Chromium is not installed; under
TRIMVLM_REQUIRE_EXTRAS (CI, which installs it) a missing Chromium fails instead."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fail_if_required, need_extra

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


site_images = _load(ROOT / ".ci" / "site_images.py", "site_images")
CHROME = site_images.browser()
fail_if_required(None if CHROME else "Chromium is not installed (Debian: apt-get install chromium)")
pytestmark = pytest.mark.skipif(CHROME is None, reason="Chromium is not installed (Debian: apt-get install chromium)")


def test_an_image_that_did_not_load_is_reported(tmp_path):
    from PIL import Image

    Image.new("RGB", (7, 5), "red").save(tmp_path / "good.png")
    (tmp_path / "bogus.png").write_text("not a PNG")
    imgs = '<img src="good.png"><img src="missing.png"><img src="bogus.png">'
    (tmp_path / "index.html").write_text(f"<html><body>{imgs}</body></html>")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "index.html").write_text('<html><body><img src="../good.png"></body></html>')
    found = {(i.page, i.src): i.width for i in site_images.check(tmp_path, CHROME)}
    assert found == {("/index.html", "good.png"): 7, ("/index.html", "missing.png"): 0,
                     ("/index.html", "bogus.png"): 0, ("/other/index.html", "../good.png"): 7}  # fmt: skip
    assert site_images.main([str(tmp_path)]) == 1


def _built_site(tmp_path: Path) -> Path:
    """site/ when `make docs` built it after the last change to docs/ and mkdocs.yml; else a fresh build."""
    site = ROOT / "site" / "index.html"
    sources = [ROOT / "mkdocs.yml", *(p for p in (ROOT / "docs").rglob("*") if p.is_file())]
    if site.is_file() and site.stat().st_mtime > max(p.stat().st_mtime for p in sources):
        return site.parent
    need_extra("mkdocs", "material", hint="the docs extra (pip install 'trimvlm[docs]')")
    out = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    return out


def test_every_image_of_the_site_loads_and_every_figure_is_shown(tmp_path):
    writer = _load(ROOT / "benchmarks" / "write_results.py", "write_results")
    results = ROOT / "docs" / "results"
    figures = {f.png.relative_to(ROOT / "docs").as_posix() for doc in writer.documents()
               for f in writer.figures(doc.read_text(), results)}  # fmt: skip
    assert len(figures) >= 12
    images = site_images.check(_built_site(tmp_path), CHROME)
    assert [i for i in images if i.width == 0] == []
    shown = {i.src.removeprefix("../") for i in images if i.width > 0}
    assert figures <= shown
