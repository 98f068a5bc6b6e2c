"""TensorBoard scalars of a job (`eval.tensorboard = true`), written by the coordinator
under DIR/tb/ with tensorboard's own event writer (no torch):

    job/accuracy, job/loss              each evaluation
    job/samples_per_s, job/staleness, job/wait_fraction
    worker-R/samples_per_s, worker-R/staleness, worker-R/wait_fraction
                                        every few seconds, from the heartbeats' counters
                                        (staleness once it counted any: never for ltfb,
                                        whose trainers read no shared model; a 0 there
                                        would be no measurement, as in summary.json)

The step of every point is the number of samples the job has processed, so that runs of
different speeds overlay on one axis (TensorBoard's "relative" or "wall" axes give time).
tensorboard is an optional extra: `pip install 'psgd[tensorboard]'`.
"""
from __future__ import annotations

import importlib.util
import os
import time

from .config import Config, ConfigError
from .consistency.staleness import Histogram


def check(cfg: Config) -> None:
    """A clear error, before any process starts, when the option is on and tensorboard is missing."""
    if cfg.eval.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("eval.tensorboard = true needs the tensorboard package: "
                          "pip install 'psgd[tensorboard]' (or pip install tensorboard)")


class Scalars:
    def __init__(self, folder: str):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        os.makedirs(folder, exist_ok=True)
        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(folder)

    def add(self, values: dict[str, float], step: float) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self.writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def workers(self, stats: dict[int, dict], step: int) -> None:
        """Per worker and for the job: samples/s, mean staleness, share of time waiting.
        A mean staleness only where the histogram counted some: ltfb's trainers count none
        (summary.json's is empty, psgd run's line and the report show none), and a 0
        drawn for them read as a measured one."""
        values: dict[str, float] = {}
        hist, busy, wait = Histogram(), 0.0, 0.0
        for r, s in sorted(stats.items()):
            elapsed = float(s.get("elapsed_s") or 0)
            if elapsed <= 0:
                continue
            h = Histogram.of(s)
            values[f"worker-{r}/samples_per_s"] = int(s.get("samples") or 0) / elapsed
            if h.total:
                values[f"worker-{r}/staleness"] = h.mean
            values[f"worker-{r}/wait_fraction"] = float(s.get("wait_s") or 0) / elapsed
            hist.merge(h)
            busy, wait = busy + elapsed, wait + float(s.get("wait_s") or 0)
        if values:
            values.update({"job/samples_per_s": sum(v for k, v in values.items() if k.endswith("samples_per_s")),
                           "job/wait_fraction": wait / busy, **({"job/staleness": hist.mean} if hist.total else {})})
            self.add(values, step)

    def close(self) -> None:
        self.writer.close()
