"""summary.json's `shard_busy_fraction`: a shard's time serving over `wall_s`, both over
the same span, the training (from its start to when the last worker was done)."""
from __future__ import annotations

import pytest

from psgd.config import Config
from psgd.metrics import summarize
from psgd.shard import Shard

pytestmark = pytest.mark.unit


def fractions(busy_s: float, wall_s: float) -> list[float]:
    return summarize(mode="sync", mode_params={}, workers=2, servers=1, wall_s=wall_s, worker_stats={},
                     server_stats={0: {"busy_s": busy_s}}, evals=[], target=0.9, failures={})["shard_busy_fraction"]


def test_a_shards_busy_time_is_its_training_s_not_the_reads_after_the_last_worker_is_done():
    """wall_s ends when the last worker is done; the shard served on after that (rank 0's
    reads while it held the end, the evaluator's final read), and its busy_s, counted over
    the process's life, said 0.6 of a 10 s training where it served 4 s of it."""
    from servers.shard_server import TrainingBusy
    served = [0.0]
    busy = TrainingBusy()
    busy.served = lambda: served[0]

    def serve(phase: str, live: dict[int, int], s: float) -> None:
        busy.track({"phase": phase, "live": live})
        served[0] += s

    serve("rendezvous", {}, 0.5)              # rank 0's initial values, before the shard hears of training
    serve("training", {0: 0, 1: 0}, 0.0)
    serve("training", {0: 7, 1: 9}, 3.5)
    serve("training", {}, 1.0)                # every worker done: rank 0 reads the model while it holds the end
    serve("final_eval", {}, 1.0)              # the evaluator's final read
    serve("settling", {}, 0.0)
    assert busy() == pytest.approx(4.0)
    assert fractions(busy(), 10.0) == [0.4]
    # no worker live, then one back (a restarted coordinator waiting for its workers): it counts on
    busy = TrainingBusy()
    busy.served, served[0] = (lambda: served[0]), 0.0
    serve("training", {0: 3}, 1.0)
    serve("training", {}, 0.25)
    serve("training", {0: 3}, 2.0)
    assert busy() == pytest.approx(3.0)


def test_a_restarted_shards_busy_time_goes_on_from_its_checkpoint():
    """A shard restarted during the run resumes its counters from its checkpoint, busy_s
    too: counted from its last process's start, it left out the earlier ones' serving
    (2.5 s of a 10 s training that it served 3.5 s of)."""
    cfg = Config()
    earlier = Shard(cfg, 0)
    earlier.busy = lambda: 2.5
    restarted = Shard(cfg, 0)
    restarted.load_state_dict(earlier.state_dict())
    assert restarted.busy() == 2.5
    assert fractions(restarted.busy() + 1.0, 10.0) == [0.35]


@pytest.mark.timeout(60)
def test_a_heartbeats_read_of_the_busy_time_while_training_ends_and_starts_again_is_whole():
    """The heartbeat thread reads the busy time while the serving thread tracks the
    coordinator's view: a read between `track`'s two changes failed ("unsupported operand
    type(s) for -: 'float' and 'NoneType'", a heartbeat lost) or counted the time since
    twice. Every read, at any moment, is one the tracking could give: never more than
    all that was served, never less than a read before it."""
    import sys
    import threading
    import time

    from servers.shard_server import TrainingBusy
    busy = TrainingBusy()
    busy.track({"phase": "settling", "live": {}})   # (nothing served yet: 0 s)
    stop, seen, failed = threading.Event(), [], []

    def heartbeats() -> None:
        try:
            while not stop.is_set():
                seen.append(busy())
        except Exception as e:
            failed.append(e)

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=heartbeats)
    reader.start()
    try:
        for _ in range(2_000):   # each span in training counts 1 s: a read shows a double count
            busy.served = lambda: (time.sleep(0), 1.0)[1]   # (a thread switch within each read: the reads
            busy.track({"phase": "training", "live": {0: 1}})   # see the tracking between its changes)
            busy.served = lambda: (time.sleep(0), 2.0)[1]
            busy.track({"phase": "settling", "live": {}})
    finally:
        stop.set()
        reader.join(10)
        sys.setswitchinterval(was)
    assert not failed, failed
    assert busy() == 2_000.0
    assert seen == sorted(seen) and max(seen) <= 2_000.0
