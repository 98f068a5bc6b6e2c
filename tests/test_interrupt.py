"""Stopping psgd's commands as a user does: Ctrl-C (SIGINT to the process group, as a
terminal sends it), SIGTERM, SIGHUP, at the moments a command is in (its work done and
the interpreter exiting, say). Every test starts its processes in a session of their own
and kills what is left of it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.processes

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}


def session(pid: int) -> list[int]:
    """The processes of the session that `pid` leads (what a terminal's job left)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == pid and fields[0] != "Z":
            found.append(int(name))
    return found


def start(argv: list[str], **kw) -> subprocess.Popen:
    """A command in a session of its own, with Ctrl-C's default action as a shell's
    foreground job has it."""
    return subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kw)


def end_session(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the session (test clean-up), and reap its leader."""
    for pid in session(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


# A psgd command whose work is done while a thread of it still runs: the interpreter's exit
# (threading._shutdown) waits for that thread, and a signal comes meanwhile.
LINGERS = """
import sys, threading, time
from psgd import cli
marker = sys.argv[1]

def linger():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    open(marker, "w").close()   # main has returned: the interpreter is exiting
    time.sleep(60)

def done(args):
    threading.Thread(target=linger).start()
    return 0

cli.cmd_run = cli.cmd_daemon = done
sys.argv = ["psgd", sys.argv[2]]
raise SystemExit(cli.main())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb,sig", [("worker", signal.SIGTERM), ("coordinator", signal.SIGINT),
                                      ("run", signal.SIGTERM), ("run", signal.SIGINT)])
def test_a_signal_while_a_command_exits_stops_it_without_a_traceback(tmp_path, verb, sig):
    """SIGTERM to the process group at the end of a `psgd run` job reached the coordinator
    after its serve() had returned, while the interpreter exited: its handler raised there
    and the terminal showed a traceback from threading._shutdown. A command whose work is
    done now ends at once on Ctrl-C or SIGTERM, quietly."""
    marker = tmp_path / "exiting"
    proc = start([sys.executable, "-c", LINGERS, str(marker), verb])
    try:
        deadline = time.monotonic() + 40
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), "the command did not get to its exit"
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=20)
    finally:
        end_session(proc)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert proc.returncode in (-sig, 128 + sig), (proc.returncode, err)
