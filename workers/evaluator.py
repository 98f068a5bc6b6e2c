"""The evaluator daemon: scores the global model on the test set every `eval.every_seconds`.

    psgd evaluator [CONFIG] --out DIR [--device ...] [--set k=v ...]

The global model is what the mode says it is (`Mode.global_model`): the shards'
parameters, which are the centre x~ in elastic averaging, or the best trainer's model
of the latest tournament, fetched whole from one deposit. Each
score goes to the coordinator (which stamps it with the samples processed so far) and
to DIR/events/evaluator-0.jsonl. When the workers are done (the coordinator's phase
`final_eval`) it scores once more, saves the model as DIR/model.pt (a state_dict;
`torch.load(path, weights_only=True)`), sends that score as the final one and exits
once the coordinator has answered it (it does not wait for `done`). A shard that
answers `not_ready` is asked again (during training: at the next period; for the final
score: until the coordinator writes the summary without one). A shard that does not
answer for `cluster.timeout_s`, or a coordinator silent that long, ends it with exit 1.
"""
from __future__ import annotations

import os
import time

import zmq

from psgd import wire
from psgd.config import Config
from psgd.consistency import get as get_mode
from psgd.data import load_dataset
from psgd.log import log
from psgd.membership import CoordinatorLink
from psgd.metrics import EventLog
from psgd.models import build_model
from psgd.replica import Replica, check_device
from psgd.shard import save_state_dict
from psgd.workers.client import ParameterClient, ShardUnreachable


class Evaluator:
    def __init__(self, cfg: Config, out: str | None = None, device: str = "auto", ctx: zmq.Context | None = None):
        self.cfg0 = cfg
        self.out = out
        self.device_spec = device
        self.ctx = ctx or zmq.Context.instance()

    def evaluate(self) -> tuple[float, float, float]:
        """(accuracy, loss, read_at): the global model's score and when it was read; its
        report says how long ago that was (`age_s`), which the coordinator takes off its
        time: the score is the model's as read, not as it is when the scoring is done.
        `read_at` is when the shards' answers had all come: a read can wait (a pull parked
        until rank 0's initial values, sync's re-read of a step closing, ltfb's wait for
        a deposit to reach every shard, a busy machine), and the model answered is the
        one of the end of that wait (in ltfb, the deposit answered was made before the
        wait, and with several shards a slice that came early is older: those scores are
        timed late, never early). Timed from the request, a score of sync's step 17
        (1,088 samples) read in 0.03 s was stamped with 418 samples: time to target and
        the accuracy-vs-samples curve credited the model earlier than it was."""
        answers = get_mode(self.cfg.mode.name).global_model(self.client)
        read_at = time.monotonic()
        self.replica.load(*self.client.tables(answers))
        acc, loss = self.replica.score_batches(self.ds.test_batches(self.cfg.eval.batch_size))
        return acc, loss, read_at

    def run(self) -> int:
        device = check_device(self.device_spec)   # before registering: one torch cannot use here is one line
        link = CoordinatorLink(self.cfg0, "evaluator", 0, self.ctx)
        answer = link.register()
        cfg = self.cfg = link.take_job_config(answer)
        link.start()   # from its registration: a silent evaluator's final score is not waited for (the coordinator)
        try:
            self.ds = load_dataset(cfg.data, cfg.job.seed)
            model = build_model(cfg.model.name, self.ds.input_shape, self.ds.num_classes, cfg.job.seed,
                                cfg.model.hidden, check=True)
            self.replica = Replica(model, cfg.cluster.servers, device, placement=cfg.placement)
            self.client = ParameterClient(cfg, self.ctx, -1)
        except BaseException:
            link.close()
            raise
        events = EventLog(self.out, "evaluator", 0)
        next_at, said = time.monotonic(), False
        try:
            while not link.done:
                if link.lost:
                    log("evaluator", f"lost the coordinator at {link.address}; exiting")
                    return 1
                phase = link.state["phase"]
                now = time.monotonic()
                if phase == "final_eval":
                    try:
                        acc, loss, read_at = self.evaluate()
                    except wire.Refused as e:   # a shard restarted after training with nothing to restore
                        if e.code != wire.NOT_READY:
                            raise
                        if not said:
                            said = True
                            log("evaluator", f"{e.peer} has no tables to score ({e.reason}); asking again until "
                                             f"the coordinator writes the summary without a final score")
                        time.sleep(0.5)
                        continue
                    self.save()
                    r = link.call("eval", accuracy=acc, loss=loss, final=True, age_s=time.monotonic() - read_at)
                    events.write(samples=r.get("samples"), accuracy=acc, loss=loss, final=True)
                    log("evaluator", f"final accuracy {acc:.4f}, loss {loss:.4f}")
                    return 0   # the coordinator has it (its answer came): nothing more is asked of this process
                elif phase == "training" and now >= next_at:
                    next_at = now + cfg.eval.every_seconds
                    try:
                        acc, loss, read_at = self.evaluate()
                    except wire.Refused as e:  # a learned model's shards before rank 0's init
                        if e.code != wire.NOT_READY:
                            raise
                        continue
                    r = link.call("eval", accuracy=acc, loss=loss, age_s=time.monotonic() - read_at)
                    events.write(samples=r.get("samples"), accuracy=acc, loss=loss)
                time.sleep(0.05)
        except ShardUnreachable as e:
            log("evaluator", f"error: {e}")
            return 1
        finally:
            link.close()
            self.client.close()
            events.close()
        return 0

    def save(self) -> None:
        if not self.out:
            return
        save_state_dict(self.replica.cpu_state_dict(), os.path.join(self.out, "model.pt"))
