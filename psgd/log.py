"""Progress and diagnostics: one line to stderr per event, prefixed with the role."""
from __future__ import annotations

import os
import sys
from typing import IO


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
    stream = stream or sys.stderr
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        to_devnull(stream.fileno())


def to_devnull(fd: int) -> None:
    """Point file descriptor `fd`, whose reader is gone (a closed pipe, a terminal that
    hung up), at /dev/null: later writes, and the exit's flush, do not fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
