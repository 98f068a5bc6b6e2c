"""psgd/log.py: a daemon's lines to a stderr that nobody reads hold none of its work."""
from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time

import pytest

from psgd.config import Config
from tests.conftest import free_port_block, kill_all

pytestmark = pytest.mark.processes

def full_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) whose buffer, one page, is full: a blocking write to
    it waits until someone reads."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 512)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    return r, w


SAYS = """
import sys, time
from psgd.log import ASIDE_LINES, flush_aside, log, write_aside
write_aside()
t0 = time.monotonic()
for i in range(ASIDE_LINES + 2000):
    log("test", f"line {i} " + "x" * 80)
print(f"said in {time.monotonic() - t0:.1f} s", flush=True)
sys.stdin.readline()   # (the test reads stderr from now on)
flush_aside(20)
"""


@pytest.mark.timeout(60)
def test_lines_to_a_stderr_nobody_reads_are_dropped_and_counted_not_waited_on():
    """`write_aside`: the lines go from a thread of their own; past ASIDE_LINES waiting,
    the oldest are dropped (the newest, a job's last, are kept), and a line where they
    were says how many."""
    import select
    import threading

    from psgd.log import ASIDE_LINES
    r, w = full_pipe()
    proc = subprocess.Popen([sys.executable, "-c", SAYS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=w,
                            text=True)
    os.close(w)
    said: list[bytes] = []
    reader = threading.Thread(target=lambda: said.extend(iter(lambda: os.read(r, 1 << 16), b"")), daemon=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)   # (without: it waits in a write, for good)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("said in "), f"no word from it in 20 s: {line!r}"
        reader.start()
        proc.stdin.write("go\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        kill_all([proc])   # (its end closes the pipe's last writer: the reader reads to the end)
        if reader.is_alive():
            reader.join(10)
        os.close(r)
    text = b"".join(said).decode(errors="replace")
    said_in_order = [("dropped" if m[1] else "line", int(m[1] or m[2])) for m in re.finditer(
        r"\[psgd\] (\d+) lines not written here: stderr was not read\n|\[psgd test\] line (\d+) x+\n", text)]
    newest = [("line", i) for i in range(2000, ASIDE_LINES + 2000)]
    taken = said_in_order[:-len(newest) - 1]   # (the one line the thread took before the pipe held it, if any)
    assert taken in ([], [("line", 0)]) and said_in_order[len(taken):] == [("dropped", 2000 - len(taken))] + newest


@pytest.mark.timeout(60)
def test_a_coordinator_whose_terminal_is_not_read_still_serves(tmp_path):
    """The coordinator writes its progress to psgd run's terminal. Paused (Ctrl-S), or a
    pipe not read (`psgd run 2>&1 | less` left alone), its write waited in the serve loop,
    whose heartbeats went unanswered until every daemon gave it up. Here its stderr is a
    full pipe from its start: it answers."""
    from psgd.status import ask
    port = free_port_block(2)
    cfg = Config().replace(**{"cluster.port": port})
    r, w = full_pipe()
    proc = subprocess.Popen([sys.executable, "-m", "psgd", "coordinator", "--out", str(tmp_path / "out"),
                             "--set", f"cluster.port={port}", "--set", "cluster.workers=1",
                             "--set", "cluster.timeout_s=30"], stdout=subprocess.DEVNULL, stderr=w)
    os.close(w)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                ask(cfg, cfg.coordinator_address())
                break
            except Exception:   # (not listening yet: asked again)
                assert proc.poll() is None and time.monotonic() < deadline, "it does not answer"
        time.sleep(7)   # its first line, "waiting: 0/1 workers registered", comes 5 s in
        assert ask(cfg, cfg.coordinator_address()).op == "reply"
    finally:
        kill_all([proc])
        os.close(r)
