"""Tests marked `own_process` run in a child pytest, one per module, never in this process.

A test that starts a Ray driver (`ray.init`) leaves the driver's native threads in the process it ran in; a
second `ray.init` / `ray.shutdown` in the same process, or the interpreter's exit after one, can then crash on
freed state (ray-project/ray#31145): the suite passed and the process died with a segmentation fault at exit.
So the first marked test of a module runs every marked test of that module (the ones this run selected) in a
child `python -m pytest`, which writes its reports (setup, call, teardown) to a file; each marked test then
reports here what its child reported, as if it had run here (pass, fail with the child's traceback, skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
from _pytest.reports import TestReport

CHILD = "TRIMVLM_TEST_CHILD_REPORTS"  # set in the child: where its reports go (one JSON line each)
TIMEOUT_S = 1800
_done: dict[str, dict[str, list[dict]]] = {}  # module path -> nodeid -> its child's reports


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "own_process: run in a child pytest (one per module), not in this process"
    )


def _child_run(item) -> dict[str, list[dict]]:
    ids = [i.nodeid for i in item.session.items if i.path == item.path and i.get_closest_marker("own_process")]
    got: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reports.jsonl")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
        try:
            run = subprocess.run(cmd, cwd=item.config.rootpath, env={**os.environ, CHILD: out},
                                 capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
            status, tail = f"exit status {run.returncode}", (run.stdout + run.stderr)[-4000:]
        except subprocess.TimeoutExpired as e:
            status, tail = f"stopped after {TIMEOUT_S} s", str(e.output or "")[-4000:]
        if os.path.exists(out):
            with open(out) as f:
                for line in f:
                    r = json.loads(line)
                    got.setdefault(r["nodeid"], []).append(r)
    for nodeid in ids:  # a test the child never reported (it crashed, or did not collect it) fails here
        if not any(r["when"] == "call" or r["outcome"] != "passed" for r in got.get(nodeid, [])):
            why = f"the child pytest ({status}) reported no result for this test:\n{tail}"
            got[nodeid] = [dict(nodeid=nodeid, when="call", outcome="failed", longrepr=why)]
    return got


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if os.environ.get(CHILD) or item.get_closest_marker("own_process") is None:
        return None
    key = str(item.path)
    if key not in _done:
        _done[key] = _child_run(item)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for r in _done[key][item.nodeid]:
        longrepr = r["longrepr"]
        if r["outcome"] == "skipped" and isinstance(longrepr, list):
            longrepr = tuple(longrepr)  # (path, line, reason): how a skip is shown
        report = TestReport(item.nodeid, item.location, dict.fromkeys(item.keywords, 1), r["outcome"], longrepr,
                            r["when"], duration=r.get("duration", 0.0))  # fmt: skip
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report):
    path = os.environ.get(CHILD)
    if not path:
        return
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):
        longrepr = [str(longrepr[0]), longrepr[1], str(longrepr[2])]
    elif longrepr is not None:
        longrepr = str(longrepr)
    with open(path, "a") as f:
        f.write(json.dumps(dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                                longrepr=longrepr, duration=report.duration)) + "\n")  # fmt: skip
