"""The report's numbers carry their units: one test per defect that a review demonstrated,
on crafted summaries (no processes)."""
from __future__ import annotations

import pytest

from psgd.report import build_rows

from .test_report_claims import run

pytestmark = pytest.mark.unit


def _cell(table: list[str], name: str, column: str) -> str:
    head = [c.strip() for c in table[0].strip("|").split("|")]
    line = next(line for line in table if line.startswith(f"| {name} |"))
    return [c.strip() for c in line.strip("|").split("|")][head.index(column)]


@pytest.mark.timeout(30)
def test_the_detail_tables_clock_gap_says_its_unit_per_mode():
    """A review: `psgd compare --modes sync,easgd:tau=4,ltfb,diloco` gave "max clock gap" 8
    for async (steps) and 10 for easgd (exchange rounds: 40 steps at tau 4) in one column,
    with no unit anywhere, and 0 for ltfb, which measures none."""
    from psgd.report_tables import CLOCK_GAP_NOTE, detail_table
    rows = build_rows([run("async", "async", max_clock_gap=8), run("easgd:tau=4", "easgd", max_clock_gap=10),
                       run("diloco", "diloco", max_clock_gap=1), run("ltfb", "ltfb", max_clock_gap=0)])
    table = detail_table(rows)
    assert _cell(table, "async", "max clock gap") == "8"
    assert _cell(table, "easgd:tau=4", "max clock gap") == "10 rounds"
    assert _cell(table, "diloco", "max clock gap") == "1 round"
    assert _cell(table, "ltfb", "max clock gap") == "—"
    assert CLOCK_GAP_NOTE in table and "exchange rounds" in CLOCK_GAP_NOTE
    # a table of step-counting modes alone needs no note
    plain = detail_table(build_rows([run("sync", max_clock_gap=0), run("async", "async", max_clock_gap=3)]))
    assert CLOCK_GAP_NOTE not in plain and _cell(plain, "async", "max clock gap") == "3"
