"""What psgd prints and writes where its output is no terminal, or no UTF-8 one: a log
file, a pipe, a C locale, a dumb or narrow terminal. One test per defect found so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import free_port_block
from .test_report_claims import CTX, run
from .test_report_review import _folder

# A locale whose codec is ASCII, UTF-8 mode off (as a latin-1 or C locale leaves it)
ASCII_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PYTHONIOENCODING": ""}


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_report_is_written_in_utf8_under_an_ascii_locale(tmp_path):
    # LC_ALL=C without UTF-8 mode: `psgd compare` ended, all its runs done, in a
    # UnicodeEncodeError traceback on report.md's "×" and wrote no report
    out = _folder(tmp_path / "cmp", [run("sync"), run("async", "async")], CTX)
    env = {**os.environ, **ASCII_LOCALE}
    got = subprocess.run([sys.executable, "-m", "psgd.report", out], env=env, capture_output=True, timeout=100)
    assert got.returncode == 0 and got.stderr == b"", got.stderr.decode(errors="replace")
    text = open(os.path.join(out, "report.md"), encoding="utf-8").read()
    assert "×" in text and "—" in text


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_config_with_non_ascii_text_runs_under_an_ascii_locale(tmp_path):
    # a job.name (or a data path) with an "é": psgd run's config.toml write, then the
    # coordinator's read of it, ended in a UnicodeEncodeError / UnicodeDecodeError traceback
    config = tmp_path / "job.toml"
    config.write_text('[job]\nname = "essai-café"\n[train]\nsteps = 10\n', encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1",
           **ASCII_LOCALE}
    got = subprocess.run([sys.executable, "-m", "psgd", "run", str(config), "--out", str(tmp_path / "run"),
                          "--set", f"cluster.port={free_port_block(3)}"], env=env, capture_output=True, timeout=240)
    err = got.stderr.decode(errors="replace")
    assert got.returncode == 0 and "Traceback" not in err, err
    assert 'name = "essai-café"' in (tmp_path / "run" / "config.toml").read_text(encoding="utf-8")
