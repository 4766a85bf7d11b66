"""Open every page of the built documentation site in headless Chromium and fail on any image that did not load.

    python .ci/site_images.py [SITE]      # SITE: the built site (default site/, what `make docs` writes)

The site is served on a local port; one checker page on the same origin loads each page in a frame, waits for its
images and posts back every <img> with its naturalWidth (0: missing, or not an image); headless Chromium runs
it and is closed once the list has come back. No driver, no PyPI package: Chromium from the system (Debian:
`apt-get install chromium`). Exit 0 when every image of every page loaded, 1 otherwise (or
when no page shows an image at all), 2 when Chromium is not installed.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHECKER = "/__site_images__.html"
RESULT = "/__site_images__/result"

# for each page in turn: load it in the frame, wait (up to 10 s) until its images are complete, note them
SCRIPT = """
const pages = %s, out = [];
const frame = document.getElementById("frame");
function settle(doc, t0, done) {
  const imgs = Array.from(doc.images);
  if (imgs.every(i => i.complete) || Date.now() - t0 > 10000) return done(imgs);
  setTimeout(() => settle(doc, t0, done), 50);
}
function next(k) {
  if (k === pages.length) return fetch("%s", {method: "POST", body: JSON.stringify(out)});
  frame.onload = () => settle(frame.contentDocument, Date.now(), imgs => {
    for (const i of imgs) out.push({page: pages[k], src: i.getAttribute("src"), width: i.naturalWidth});
    next(k + 1);
  });
  frame.src = pages[k];
}
next(0);
"""


class Image(NamedTuple):
    page: str
    src: str
    width: int


def browser() -> str | None:
    """The Chromium executable on PATH, or None."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def pages(site: Path) -> list[str]:
    """Every HTML page of the site as a path from its root (the theme's assets left out)."""
    found = (p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    return sorted("/" + p for p in found if not p.startswith("assets/"))


def _handler(site: Path, checker: bytes, posted: dict, done: threading.Event):
    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server name)
            if self.path != CHECKER:
                return super().do_GET()
            self._reply(checker, "text/html; charset=utf-8")

        def do_POST(self):  # noqa: N802
            if self.path == RESULT:
                posted["images"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                done.set()
            self._reply(b"", "text/plain")

        def _reply(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    return functools.partial(Handler, directory=str(site))


def check(site: Path, chrome: str, timeout: float = 180) -> list[Image]:
    """Every <img> of every page of `site`, with the width Chromium loaded it at (0: it did not load)."""
    script = SCRIPT % (json.dumps(pages(site)), RESULT)
    page = f'<html><body><iframe id="frame" width="1280" height="900"></iframe><script>{script}</script></body></html>'
    posted, done = {}, threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(site, page.encode(), posted, done))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               f"--user-data-dir={profile}", f"http://127.0.0.1:{server.server_address[1]}{CHECKER}"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            done.wait(timeout)
        finally:
            proc.terminate()
            proc.wait(30)
            server.shutdown()
            server.server_close()
    if "images" not in posted:
        raise RuntimeError(f"Chromium did not finish the checker page in {timeout:.0f} s")
    return [Image(i["page"], i["src"], i["width"]) for i in posted["images"]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    site = Path(argv[0] if argv else "site")
    if not (site / "index.html").is_file():
        print(f"{site}: not a built site (no index.html); run `make docs` first", file=sys.stderr)
        return 1
    chrome = browser()
    if chrome is None:
        print(f"no Chromium on PATH (looked for {', '.join(BROWSERS)}); Debian: apt-get install chromium",
              file=sys.stderr)  # fmt: skip
        return 2
    images = check(site, chrome)
    broken = [i for i in images if i.width == 0]
    for i in broken:
        print(f"{i.page}: image {i.src} did not load")
    shown = len({i.page for i in images})
    print(f"{len(pages(site))} pages, {len(images)} images on {shown} of them, {len(broken)} did not load")
    return 1 if broken or not images else 0


if __name__ == "__main__":
    raise SystemExit(main())
