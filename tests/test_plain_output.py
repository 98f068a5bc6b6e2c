"""What psgd prints and writes where its output is no terminal, or no UTF-8 one: a log
file, a pipe, a C locale, a dumb or narrow terminal. One test per defect found so."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest

import psgd.compare
from psgd.compare import Monitor

from .conftest import free_port_block
from .test_compare_output import compare_args
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


class Terminal(io.StringIO):
    """A stream that says it is a terminal; `screen()` is what it shows, line by line."""

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        return [line.split("\r\033[K")[-1] for line in self.getvalue().split("\n")]


def shown(terminal: Terminal, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in terminal.getvalue():
        assert time.monotonic() < deadline, terminal.getvalue()[-300:]
        time.sleep(0.01)


def progress_shown(tmp_path, monkeypatch, label: str, until: str, **env: str) -> str:
    """What compare's progress line (a `Monitor` labelled `label`) wrote to a terminal
    (sys.stderr), with the environment variables `env`, once `until` was on it."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with Monitor(label, str(tmp_path), 100, every_s=0.01):
        shown(terminal, until)
    return terminal.getvalue()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_compare_progress_line_fits_a_narrow_terminal(tmp_path, monkeypatch):
    # wider than the terminal, the line wrapped, and each update left its first rows behind
    written = progress_shown(tmp_path, monkeypatch, "[12/120]", "\r\033[K[12/120]", COLUMNS="20")
    updates = written.split("\r\033[K")[1:]
    assert updates and all(len(u) <= 19 for u in updates), updates[:3]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_dumb_terminal_gets_progress_lines_without_escapes(tmp_path, monkeypatch):
    # TERM=dumb (Emacs' shell): the updating line's \r\033[K showed as "^[[K" before each update
    written = progress_shown(tmp_path, monkeypatch, "[1/1]", "starting processes", TERM="dumb")
    assert "\033" not in written and "\r" not in written, written[:200]
    assert written.startswith("[1/1]") and written.endswith("starting processes\n")


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_a_compare_interrupted_in_a_pipe_whose_reader_ended_writes_the_report_of_the_runs_done(tmp_path,
                                                                                              monkeypatch):
    # Ctrl-C on `psgd compare ... 2>&1 | tee log` ends tee too: the line "interrupted after 1
    # of 2 runs" raised BrokenPipeError, and the run done got no report (exit 141)
    calls = []

    def run_one(run, folder, device, timeout_s, prefix=""):
        calls.append(run.label)
        if len(calls) > 1:
            os.close(read)   # tee ends with the Ctrl-C
            raise KeyboardInterrupt
        raise RuntimeError("the job did not finish")   # (a run done, failed: its report needs no plots)
    read, write = os.pipe()
    pipe = open(write, "w")
    monkeypatch.setattr(sys, "stderr", pipe)
    monkeypatch.setattr(sys, "stdout", pipe)
    monkeypatch.setattr(psgd.compare, "run_one", run_one)
    out = tmp_path / "cmp"
    try:
        assert psgd.compare.main(compare_args(out, "sync,async")) == 130
    finally:
        monkeypatch.undo()
        pipe.close()
    assert calls == ["sync", "async"] and (out / "report.md").exists()
