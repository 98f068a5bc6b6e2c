"""Progress and diagnostics: one line to stderr per event, prefixed with the role."""
from __future__ import annotations

import os
import queue
import stat
import sys
import threading
import time
from typing import IO

# Lines waiting for `write_aside`'s thread (None: each is written by the thread that says
# it), and how many were dropped since the last one written (the queue was full).
_aside: queue.Queue[str] | None = None
_dropped = 0
ASIDE_LINES = 1000


def log(role: str, text: str) -> None:
    """`[psgd ROLE] text` to stderr, as `say` writes it: a reader gone (`psgd run ... 2>&1 |
    tee log` after a Ctrl-C ended tee) raised BrokenPipeError from the launcher's stop's
    lines, and the stop was cut short."""
    say(f"[psgd {role}] {text}")


def say(text: str, stream: IO[str] | None = None) -> None:
    """print(text) to `stream` (default stderr), or to nothing where its reader is gone:
    Ctrl-C on `psgd compare ... 2>&1 | tee log` (or `psgd run`) ends tee too, and the line
    that said the command was interrupted raised BrokenPipeError: compare's runs done got
    no report, and each command's exit was 141, not its signal's. The stream is /dev/null
    from then on (a later line, and the exit's flush, would fail again)."""
    global _dropped
    if stream is None and _aside is not None:
        try:
            _aside.put_nowait(text)
        except queue.Full:
            _dropped += 1
        return
    stream = stream or sys.stderr
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        to_devnull(stream.fileno())


def write_aside(most: int = ASIDE_LINES) -> None:
    """From now on `say` writes this process's lines to stderr from a thread of its own,
    with at most `most` waiting, where stderr is not a file (a terminal, a pipe): a
    coordinator's serve loop was held by a reader that stopped reading (a terminal paused
    with Ctrl-S, `psgd run 2>&1 | less` left alone past the pipe's 64 KiB), and the
    heartbeats it did not answer meanwhile had every daemon give it up. Lines beyond
    `most` are dropped, and how many is said with the next line written."""
    global _aside
    try:
        if _aside is not None or stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode):
            return
    except (OSError, ValueError, AttributeError):   # (no descriptor: a caller's stream)
        return
    lines: queue.Queue[str] = queue.Queue(most)

    def write() -> None:
        global _dropped
        while True:
            text = lines.get()
            dropped, _dropped = _dropped, 0
            try:
                if dropped:
                    say(f"[psgd] {dropped} line{'s' * (dropped > 1)} not written here: stderr was not read",
                        sys.stderr)
                say(text, sys.stderr)
            except OSError:   # (a terminal that hung up: the process says nothing more there)
                pass
            finally:
                lines.task_done()
    threading.Thread(target=write, name="stderr", daemon=True).start()
    _aside = lines


def flush_aside(timeout_s: float = 2.0) -> None:
    """Wait up to `timeout_s` for `write_aside`'s lines to be written (a process's end)."""
    lines = _aside
    deadline = time.monotonic() + timeout_s
    while lines is not None and lines.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)


def to_devnull(fd: int) -> None:
    """Point file descriptor `fd`, whose reader is gone (a closed pipe, a terminal that
    hung up), at /dev/null: later writes, and the exit's flush, do not fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
