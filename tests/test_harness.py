"""The test harness itself (tests/conftest.py): every test has a tier, and an in-process
test fails when it leaves a thread running. Each case runs pytest on a small test file
in a folder of its own, with a copy of conftest.py."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

CONFTEST = Path(__file__).with_name("conftest.py")
INI = """[pytest]
addopts = -p no:cacheprovider --strict-markers
markers =
    unit: u
    inprocess: i
    processes: p
    slurm: s
"""


def pytest_on(tmp_path: Path, tests: str, **more_files: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    for name, text in more_files.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_case.py").write_text(textwrap.dedent(tests))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(120)
def test_an_inprocess_test_that_leaves_a_thread_running_fails(tmp_path):
    r = pytest_on(tmp_path, """
        import threading, time
        import pytest
        import conftest
        conftest.THREAD_GRACE_S = 2.0   # "short" ends 0.2 s after its start: a margin for a loaded machine
        forever = threading.Event()

        @pytest.mark.inprocess
        def test_leaks():
            threading.Thread(target=forever.wait, name="heartbeat-worker", daemon=True).start()

        @pytest.mark.inprocess
        def test_its_thread_ends_within_the_grace():
            threading.Thread(target=time.sleep, args=(0.2,), name="short").start()

        @pytest.mark.unit
        def test_not_checked():
            threading.Thread(target=forever.wait, name="unit-thread", daemon=True).start()
    """)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # the error: test_leaks's teardown
    assert "ERROR at teardown of test_leaks" in out
    assert "test left 1 thread(s) running 2 s after it ended: heartbeat-worker (daemon, Event.wait)" in out
    assert "short (" not in out and "unit-thread (" not in out


@pytest.mark.timeout(120)
def test_a_test_without_a_tier_or_with_two_is_refused(tmp_path):
    r = pytest_on(tmp_path, """
        import pytest

        pytestmark = pytest.mark.unit

        def test_tiered():
            pass

        @pytest.mark.unit
        def test_tiered_twice_alike():
            pass

        @pytest.mark.processes
        def test_two_tiers():
            pass
    """, test_other="def test_untiered():\n    pass\n")
    out = r.stdout + r.stderr
    assert r.returncode == 4, out  # a usage error: nothing ran
    assert "tests without a tier marker" in out and "test_other.py::test_untiered" in out
    assert "tests with more than one tier" in out and "test_case.py::test_two_tiers: processes + unit" in out
    assert "::test_tiered" not in out
