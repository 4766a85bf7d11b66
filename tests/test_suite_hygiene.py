"""The suite's own guarantees: each test runs in a scratch directory of its own, and `--reverse-files` runs the
test files last first, each file's tests in their own order (CI runs the suite so: `make test PYTEST_ARGS=--reverse-files`)."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

FILES = ["tests/test_structure.py", "tests/test_docs.py"]


def test_each_test_runs_in_its_own_scratch_directory(tmp_path):
    assert Path.cwd() == tmp_path and REPO not in Path.cwd().parents


def _collected(*args: str) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_reverse_files_runs_the_files_last_first():
    plain, reverse = _collected(*FILES), _collected("--reverse-files", *FILES)
    assert list(dict.fromkeys(t.split("::")[0] for t in plain)) == FILES
    assert list(dict.fromkeys(t.split("::")[0] for t in reverse)) == FILES[::-1]
    for f in FILES:  # a file's tests keep their order
        assert [t for t in reverse if t.startswith(f)] == [t for t in plain if t.startswith(f)]
