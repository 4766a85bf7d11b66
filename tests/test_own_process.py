"""tests/own_process.py: a module's `own_process` tests run in one child pytest and report here as they ran
there (passed, failed with the child's message, skipped with its reason); one the child never reports (it
died) fails; unmarked tests run in this process."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from own_process import CHILD

MARKED = """
    import os
    import pytest

    pytestmark = pytest.mark.own_process

    def test_passes_in_the_child():
        assert os.environ.get("{child}")

    def test_fails_in_the_child():
        assert os.getpid() < 0, "the child's own message"

    @pytest.mark.skip(reason="skipped by the child")
    def test_skipped():
        pass

    def test_kills_the_child():
        os._exit(3)
"""


def test_marked_tests_run_in_a_child_and_report_here(tmp_path):
    tests = Path(__file__).parent
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(tests)!r})\n"
                                          "pytest_plugins = ('own_process',)\n")  # fmt: skip
    (tmp_path / "test_marked.py").write_text(textwrap.dedent(MARKED.format(child=CHILD)))
    (tmp_path / "test_here.py").write_text(
        f"import os\n\ndef test_here():\n    assert not os.environ.get({CHILD!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != CHILD}
    run = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out
    assert "2 failed, 2 passed, 1 skipped" in out, out
    assert (
        "PASSED test_marked.py::test_passes_in_the_child" in out and "PASSED test_here.py::test_here" in out
    )
    assert "FAILED test_marked.py::test_fails_in_the_child" in out and "the child's own message" in out
    assert "skipped by the child" in out
    assert "FAILED test_marked.py::test_kills_the_child" in out and "exit status 3" in out
