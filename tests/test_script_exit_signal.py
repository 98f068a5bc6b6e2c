"""Ctrl-C to psgd run's process group as its training scripts exit, their work done: the
signal reaches the scripts too, and one still tearing down (torch's teardown took 0.5-1 s
on this project's machines) dies of it. psgd run said "interrupted; its daemons are
stopped" and exited 130 about 1 s after the job had written summary.json and model.pt;
it now reports the finished job (exit 0, noting that the signal came after its end)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port_block
from tests.test_interrupt import SUMMARY, defaults, end_session, run_then_signal, start

# A Python process whose work is done while its interpreter still tears down (a module
# global's __del__, after the exit handlers: as torch's teardown), which says when.
TEARS_DOWN = """
import sys, time
class Slow:
    def __del__(self, sleep=time.sleep, out=sys.stdout):
        print("tearing down", file=out, flush=True)
        sleep(30)
slow = Slow()
print("working", flush=True)
sys.stdin.readline()
"""


def _read_until(proc: subprocess.Popen, text: str, deadline: float) -> None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        assert line, f"ended before {text!r}"
    raise AssertionError(f"no {text!r} in time")


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_python_process_is_told_exiting_once_its_exit_handlers_have_run():
    from psgd.launcher import script_exiting
    # (Ctrl-C's default action, as a shell's foreground job has it: a test run in the background, as CI's
    # was, passes SIGINT ignored to its children, and a Python started so never handles it)
    proc = subprocess.Popen([sys.executable, "-c", TEARS_DOWN], preexec_fn=defaults, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        _read_until(proc, "working", time.monotonic() + 30)
        assert script_exiting(proc.pid) is False   # its code runs: Ctrl-C would be its KeyboardInterrupt
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        _read_until(proc, "tearing down", time.monotonic() + 30)
        assert script_exiting(proc.pid) is True
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == -signal.SIGINT
        assert script_exiting(proc.pid) is None   # (reaped: nothing to tell)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_signal_that_ended_exiting_scripts_after_the_job_ended_reports_the_finished_job(monkeypatch, tmp_path,
                                                                                           capsys):
    """The launcher sees, as it waits, which scripts' Python is exiting; a signal that then
    ends them (the group's Ctrl-C, -2) cut nothing short: the job is reported (0). One
    that ends a script still at its work after close() is an interrupt (130)."""
    from psgd import launcher
    from psgd.launcher import LocalJob
    stop = LocalJob.stop
    for exiting, want in ((True, 0), (False, 130)):
        seen = iter([False, exiting])
        monkeypatch.setattr(launcher, "script_exiting", lambda pid, seen=seen, last=exiting: next(seen, last))

        def watched_then_stopped(job: LocalJob) -> None:
            """What the launcher saw as it waited, before the signal: each script running
            (looked at twice: its Python handling SIGINT, then `exiting`), then ended by the
            group's Ctrl-C (-2)."""
            for c in job.children:
                c.proc.code = None
            job._watch_scripts()
            job._watch_scripts()
            for c in job.children:
                c.proc.code = -signal.SIGINT
            stop(job)
        monkeypatch.setattr(LocalJob, "stop", watched_then_stopped)
        code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, SUMMARY, [-signal.SIGINT])
        assert code == want, err
        if want == 0:
            assert "sync: accuracy 0.9700" in out and "interrupted after the job had ended; its outputs are " \
                                                      "complete" in err, err
        else:
            assert out == "" and "psgd run: interrupted; its daemons are stopped" in err, err
        monkeypatch.setattr(LocalJob, "stop", stop)

SCRIPT = """
import sys, time
import torch
from torch import nn
import psgd

class Slow:   # the interpreter's teardown after the script's work (torch's takes 0.5-1 s)
    def __del__(self, sleep=time.sleep, out=sys.stdout):
        print("tearing down", file=out, flush=True)
        sleep(20)
slow = Slow()
model = nn.Linear(4, 2)
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
with psgd.connect(model, None) as ps:
    for i in range(1000):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if not ps.step(loss, samples=len(y)):
            break
    ps.report(accuracy=0.5, loss=loss.item())
"""


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_ctrl_c_as_the_scripts_of_an_ended_job_exit_reports_the_finished_job(tmp_path):
    script, out = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SCRIPT)
    proc = start([sys.executable, "-m", "psgd", "run", "--quiet", "--script", str(script), "--out", str(out),
                  "--workers", "2", "--servers", "1", "--set", "train.steps=20",
                  "--set", f"cluster.port={free_port_block(3)}"])
    try:
        deadline = time.monotonic() + 180
        logs = [out / "logs" / f"worker-{r}.log" for r in range(2)]
        while time.monotonic() < deadline and proc.poll() is None and not (
                (out / "summary.json").exists()
                and all(f.exists() and "tearing down" in f.read_text() for f in logs)):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)   # (psgd run looks at its scripts every 0.1 s)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-3000:]
        assert "psgd run: interrupted after the job had ended; its outputs are complete" in stderr, stderr[-3000:]
        assert f"summary: {out}/summary.json" in stdout and "model:" in stdout, stdout
    finally:
        end_session(proc)
