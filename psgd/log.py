"""Progress and diagnostics: one line to stderr per event, prefixed with the role."""
from __future__ import annotations

import sys


def log(role: str, text: str) -> None:
    print(f"[psgd {role}] {text}", file=sys.stderr, flush=True)
