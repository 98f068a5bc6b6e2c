"""The report's wording and plots where a review found them misleading: one configuration
called "the best", a simulated report's time in seconds, the baseline's hidden error bar.
Crafted summaries, no processes."""
from __future__ import annotations

import pytest

from tests.test_report_claims import failed, run, sentence, told

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("base_sps,says", [
    ((9000.0, 9100.0), "The sequential baseline alone processed 9,050 samples/s, 1.8× **sync**: the per-step cost"),
    ((2000.0, 2100.0), "**sync** processed 2.46× the samples per second of the sequential baseline (2,050)."),
    ((4000.0, 6000.0), "The sequential baseline alone processed 5,000 samples/s, not told apart from **sync**'s "
                       "5,050 (within two run-to-run sds).")])
def test_the_one_distributed_configuration_that_finished_is_named_not_called_the_best(base_sps, says):
    """async failed in both repeats and sync finished: the reading said the baseline ran at
    '1.8× the best distributed configuration', a best of one."""
    results = [run("baseline", "baseline", r, ttt=1.0, wall=5.0, sps=s, workers=1) for r, s in enumerate(base_sps)]
    results += [run("sync", repeat=r, ttt=2.0, sps=s) for r, s in enumerate((5000.0, 5100.0))]
    results += [failed("async", "async", r) for r in range(2)]
    text = told(results)
    assert "the best distributed configuration" not in text, text
    s = sentence(text, "samples per second of" if "2.46" in says else "The sequential baseline alone")
    assert says in s, s


@pytest.mark.timeout(60)
def test_the_main_tables_time_column_of_simulated_rows_says_virtual():
    """psgd simulate's main table headed its virtual times to target 'time to 0.9 (s)',
    where its detail table says 'virtual wall (s)'."""
    from psgd.report import build_rows
    from psgd.report_tables import main_table
    sim = [run(m, m, ttt=1.0, simulated=True) for m in ("sync", "async")]
    real = [run(m, m, ttt=1.0) for m in ("sync", "async")]
    assert "| final accuracy | time to 0.9 (virtual s) | samples/s |" in main_table(build_rows(sim), 0.9)[0]
    assert "| final accuracy | time to 0.9 (s) | samples/s |" in main_table(build_rows(real), 0.9)[0]
    assert "| time to 0.9 (s; virtual for the rows marked (simulated)) |" in main_table(build_rows(sim + real), 0.9)[0]
    merged = build_rows(sim + [failed("ssp", "ssp", 0)])   # (a failed row has no kind: still all simulated)
    assert "| time to 0.9 (virtual s) |" in main_table(merged, 0.9)[0]


@pytest.mark.timeout(60)
def test_the_baselines_error_bar_shows_on_its_black_bar(monkeypatch):
    """throughput.png drew every error bar black, the baseline's on its own black bar: the
    half of it below the mean could not be seen."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from psgd.report import build_rows
    from psgd.report_plots import _colors, _throughput_plot
    results = [run("baseline", "baseline", r, workers=1, sps=s) for r, s in enumerate((9000.0, 11000.0))]
    results += [run("sync", repeat=r, sps=s) for r, s in enumerate((4000.0, 6000.0))]
    rows = build_rows(results)
    seen: list[float] = []

    def savefig(fig, path, **kw):   # the lower half of the baseline's bar: any pixel there not black?
        fig.canvas.draw()
        px = np.asarray(fig.canvas.buffer_rgba())[:, :, :3] / 255.0
        ax = fig.axes[0]
        h = px.shape[0]
        (x0, y_lo), (_, y_hi) = ax.transData.transform([(0, 10000.0 - 1414.0 * 0.8), (0, 10000.0 - 1414.0 * 0.2)])
        band = px[int(h - y_hi):int(h - y_lo), int(x0) - 6:int(x0) + 7]
        seen.append(float(band.max()))
    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    assert rows[0].is_baseline
    _throughput_plot(plt, rows, _colors(rows), "throughput.png")
    assert seen and seen[0] > 0.8, seen   # (white: the bar's black beside a black line alone)
