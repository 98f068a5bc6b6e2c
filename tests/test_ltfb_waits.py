"""LTFB trainer groups whose followers wait for a round's outcome: every wait ends with
the outcome (or with the leader gone), never with a job that hangs.

The unit tests' workers are threads over `Shard` objects (`WaitingLoopback`: a request
parked on a shard waits, as ParameterClient's does, and gives up with TimeoutError after
`GIVE_UP_S`, which these tests count as the hang they pin); one test runs the job's real
processes, as `psgd run` does, and kills a leader in its tournament.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from psgd.config import Config, load
from psgd.consistency.ltfb import LtfbSchedule
from psgd.launcher import LocalJob
from psgd.shard import Shard
from tests.conftest import free_port_block
from tests.loopback import FakeTrainer, flat
from tests.test_ltfb import TourLoopback, WaitingLoopback, grad, ltfb_cfg, trainers_on
from tests.test_reliability import child, coordinator_story, log_tail, wait_for_steps

ROUNDS_END = 6   # the clock the workers train to: rounds 1 and 2 (round_steps 3)


class Killed(BaseException):
    """A worker process killed (kill -9) at this point: its thread ends there."""


def group_cfg(**sets) -> Config:
    """2 trainers of 2 workers, rounds of 3 steps."""
    return ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2, "mode.round_steps": 3, **sets})


def waiting(shards: list[Shard], ts: list) -> None:
    for w, _ in ts:
        w.client = WaitingLoopback(shards, w.rank)


def train(w, s, errors: list[str], start: bool = False) -> None:
    """A worker's loop to ROUNDS_END (after `s.start`, a restarted process's); an error
    is kept, a kill ends it quietly."""
    try:
        if start:
            s.start(w)
        while w.clock < ROUNDS_END:
            s.step(w)
    except Killed:
        pass
    except BaseException as e:   # noqa: BLE001
        errors.append(f"rank {w.rank}: {e!r}")


def restarted(cfg: Config, shards: list[Shard], rank: int, clock: int, taken_back: bool = True):
    """A new process for `rank` (of 4, all live: restarted before the coordinator missed
    it, `taken_back`; else after it was dropped), registered at `clock`, not started
    yet: (trainer, schedule)."""
    w = FakeTrainer(cfg, WaitingLoopback(shards, rank), grad, rank)
    w.holdout = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    w.live = lambda: {0, 1, 2, 3}
    w.events = []
    w.event = lambda **f: w.events.append(f)
    w.clock = clock
    w.taken_back = taken_back
    return w, LtfbSchedule(cfg)


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(3 * WaitingLoopback.GIVE_UP_S)
    assert not any(t.is_alive() for t in threads), "a worker still waits"


def same_lines(a: list[dict], b: list[dict]) -> bool:
    """Do two workers' tournament lines agree, but for who wrote them, and when?"""
    drop = lambda e: {k: v for k, v in e.items() if k not in ("rank", "t")}  # noqa: E731
    return [drop(e) for e in a] == [drop(e) for e in b]


@pytest.mark.unit
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,clock", [("pairwise", 2), ("truncation", 2), ("pairwise", 0)])
def test_a_leader_restarted_mid_tournament_plays_the_round_its_followers_wait_for(strategy, clock):
    """A review: a trainer's leader killed during round 1's tournament, after its deposit
    and before its outcome, and started again before the coordinator missed it (so it
    never left the live set, which is what cancels its followers' wait), continued from
    its trainer's round-1 deposit (`trainer_model`) at round 1's step, and deposited no
    outcome: its follower waited for round 1's outcome while the leader's group step
    waited for the follower's push. The job hung (each request parked, its shard
    answering probes: no client timeout ends that). The restarted leader now plays the
    round that its earlier process deposited and left without an outcome, also where
    its rank's heartbeats had reported no clock yet (registered at clock 0: a second
    review found it took the path of a job's start then, and the group hung)."""
    cfg = group_cfg(**{"mode.strategy": strategy})
    shards, ts = trainers_on(cfg, 4)
    waiting(shards, ts)
    w0, s0 = ts[0]

    def killed_after_its_deposit(*args):
        raise Killed
    s0.select = killed_after_its_deposit
    errors: list[str] = []
    threads = [threading.Thread(target=train, args=(w, s, errors), daemon=True) for w, s in ts]
    for t in threads:
        t.start()
    threads[0].join(3 * WaitingLoopback.GIVE_UP_S)
    assert not threads[0].is_alive() and w0.clock == 3 and not w0.events
    w, s = restarted(cfg, shards, 0, clock)  # its last heartbeat's clock
    again = threading.Thread(target=train, args=(w, s, errors, True), daemon=True)
    again.start()
    join(threads[1:] + [again])
    assert not errors, errors
    w1 = ts[1][0]
    assert w.clock == w1.clock == ROUNDS_END
    assert [e["round"] for e in w.events] == [e["round"] for e in w1.events] == [1, 2]
    assert same_lines(w.events, w1.events) and {e["leader"] for e in w1.events} == {0}
    assert torch.equal(flat(w.replica.params()), flat(w1.replica.params()))


def on_loopback(cfg: Config, shards: list[Shard], rank: int, clock: int):
    """`restarted`, over a loopback that answers at once (no threads), started."""
    w, s = restarted(cfg, shards, rank, clock)
    w.client = TourLoopback(shards, rank)
    s.start(w)
    return w, s


def outcome_rounds(shards: list[Shard], trainer: int) -> list[int]:
    """Each shard's round of `trainer`'s latest outcome (0: none)."""
    return [s.rule.outcomes.latest.get(trainer, (0, None))[0] for s in shards]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_rejoiner_plays_again_only_a_round_that_its_own_rank_left_without_an_outcome():
    """The round is played again only by a new process of the rank that deposited it:
    where another rank of the trainer played it (its leader while this one was gone),
    that one deposits the outcome, and a second player would put a second, different
    outcome beside it on the shards; a process taken back after a partition had left the
    live set, which ended its followers' wait. A checkpoint that did not keep who
    deposited a round says nobody."""
    cfg = group_cfg()
    shards, ts = trainers_on(cfg, 4)
    (w0, s0), (w1, s1), (w2, s2) = ts[0], ts[1], ts[2]
    s2.deposit_model(w2, 1, 0.5)             # trainer 1's round 1: the partner's model
    s1.deposit_model(w1, 1, 0.5)             # rank 1 plays round 1 for trainer 0 (rank 0 was gone)
    w, _ = on_loopback(cfg, shards, 0, 2)
    assert w.clock == 3 and not w.events and outcome_rounds(shards, 0) == [0, 0]
    s0.deposit_model(w0, 1, 0.5)             # rank 0 played it, and ended before its outcome
    w0.clock = 2
    s0.rejoin(w0)                            # the same process, taken back after a partition: its
    assert not w0.events and outcome_rounds(shards, 0) == [0, 0]   # followers' wait ended as it left
    for s in shards:
        s.load_state_dict({**s.state_dict(), "rule": {**s.state_dict()["rule"], "players": []}})
    w, _ = on_loopback(cfg, shards, 0, 2)
    assert not w.events and outcome_rounds(shards, 0) == [0, 0]
    s0.deposit_model(w0, 1, 0.5)
    w, _ = on_loopback(cfg, shards, 0, 2)
    assert [e["round"] for e in w.events] == [1] and w.clock == 3 and outcome_rounds(shards, 0) == [1, 1]
    w, _ = on_loopback(cfg, shards, 1, 2)    # the round's outcome is there: nothing to play
    assert not w.events and w.clock == 3
    s0.deposit_model(w0, 2, 0.5)             # rank 0 played round 2, and ended before its outcome,
    w, s = restarted(cfg, shards, 0, 4, taken_back=False)   # after the coordinator had dropped it:
    w.client = TourLoopback(shards, 0)       # its followers' wait ended as it left the live set
    s.start(w)
    assert not w.events and w.clock == 6 and outcome_rounds(shards, 0) == [1, 1]


def trained(ts: list) -> None:
    """Train every (trainer, schedule) of `ts` on a thread of its own to the end, with no errors."""
    errors: list[str] = []
    threads = [threading.Thread(target=train, args=(w, s, errors), daemon=True) for w, s in ts]
    for t in threads:
        t.start()
    join(threads)
    assert not errors, errors


def trained_together(ts: list) -> None:
    """`trained`, and the first two (a trainer group) end at the same clock, with the
    same tournament lines and the same model."""
    trained(ts)
    (w0, _), (w1, _) = ts[0], ts[1]
    assert w0.clock == w1.clock == ROUNDS_END and same_lines(w0.events, w1.events)
    assert torch.equal(flat(w0.replica.params()), flat(w1.replica.params()))


WINDOW_S = 1.0   # cluster.heartbeat_timeout_s: the leader's first window after an outcome (`group_exchange`)


def quick_windows(**sets) -> Config:
    """`group_cfg` whose leader's windows after an outcome are short, for tests that wait them out."""
    return group_cfg(**{"cluster.heartbeat_s": WINDOW_S / 2, "cluster.heartbeat_timeout_s": WINDOW_S, **sets})


def restore_on(shard: Shard, checkpoint: dict, restored: threading.Event) -> None:
    """A kill -9 of `shard` and its restart from `checkpoint`."""
    with WaitingLoopback.lock:
        shard.load_state_dict(checkpoint)
    restored.set()


def after_restore(s: LtfbSchedule, restored: threading.Event) -> None:
    """The follower `s` asks for its round's outcome only once the shard is restored."""
    real = s.follow

    def follow(w, rnd, leader):
        assert restored.wait(WaitingLoopback.GIVE_UP_S)
        real(w, rnd, leader)
    s.follow = follow


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_follower_gets_an_outcome_that_a_restored_shard_lost():
    """A review: the leader deposited round 1's outcome on every shard; shard 0 was then
    killed and restored from its periodic checkpoint, written before that deposit,
    before the follower asked for the outcome. Shard 0 parked the follower's request
    until the outcome was deposited, which nobody did again: the leader had gone on to
    its next group step, which waited for the follower's push. The job hung. The leader
    now keeps the outcome until that step closes, and deposits it again where a shard
    lacks it at the end of each window it waits there."""
    cfg = quick_windows()
    shards, ts = trainers_on(cfg, 4)
    waiting(shards, ts)
    (w0, s0), s1 = ts[0], ts[1][1]
    notes: list[str] = []
    w0.note = notes.append
    restored = threading.Event()
    real_deposit = s0.deposit

    def deposit(w, rnd, *args):
        if rnd != -1:
            return real_deposit(w, rnd, *args)
        # After the outcome, restored from before it, with no other worker's request
        # between: one answered there would be lost with the restore, and a loopback does
        # not send it again (the real client does, to a restarted shard).
        with WaitingLoopback.lock:
            checkpoint = shards[0].state_dict()
            real_deposit(w, rnd, *args)
            restore_on(shards[0], checkpoint, restored)
    s0.deposit = deposit
    after_restore(s1, restored)
    trained_together(ts)
    assert "round 1: a shard lost trainer 0's outcome (or holds another of the round); depositing it again" in notes


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_leaders_push_that_a_restored_shard_lost_goes_again():
    """The leader's first step after an outcome pushes alone (its read waits in windows,
    `group_exchange`), and a push answered is not sent again by the client, as a push
    with its read is: shard 0 killed after the leader's push of that step, restored from
    a checkpoint written after the outcome and before that push, waited for good for the
    leader's push, and the follower's and the leader's reads with it. The push goes
    again at each window's end (one trainer of two workers: no other trainer's step is
    on the restored shard)."""
    cfg = quick_windows(**{"cluster.workers": 2})
    shards, ts = trainers_on(cfg, 2)
    waiting(shards, ts)
    (w0, s0), s1 = ts[0], ts[1][1]
    restored = threading.Event()
    checkpoints: list[dict] = []
    real_deposit, real_push = s0.deposit, w0.client.begin_push_pull

    def deposit(w, rnd, *args):
        real_deposit(w, rnd, *args)
        if rnd == -1:
            checkpoints.append(shards[0].state_dict())

    def push(clock, *args, pull=True):
        sent = real_push(clock, *args, pull=pull)
        if clock == 3 and not pull and not restored.is_set():   # its first push after round 1's outcome
            restore_on(shards[0], checkpoints[0], restored)
        return sent
    s0.deposit, w0.client.begin_push_pull = deposit, push
    after_restore(s1, restored)
    trained_together(ts)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_kept_outcome_costs_a_group_that_lost_nothing_no_window():
    """With nothing lost, the leader's first step after an outcome is answered when its
    follower pushes, as any step: no window waited out (one longer than a request's
    GIVE_UP_S here, which it would raise), no index asked, and the outcome let go once
    the step closed."""
    cfg = group_cfg(**{"cluster.heartbeat_timeout_s": 3 * WaitingLoopback.GIVE_UP_S})
    shards, ts = trainers_on(cfg, 4)
    waiting(shards, ts)
    w0, s0 = ts[0]
    kept: list[int] = []
    s0.keep_outcome = lambda w, rnd, *args: kept.append(rnd)
    trained(ts)
    assert [w.clock for w, _ in ts] == [ROUNDS_END] * 4 and not kept
    assert s0.outcome is not None and s0.outcome[0] == -2   # round 1's let go; round 2's step is not taken


def tournament_lines(out: str, rank: int) -> list[dict]:
    with open(os.path.join(out, "events", f"worker-{rank}.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("event") == "tournament"]


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_leader_killed_in_its_tournament_and_restarted_at_once_does_not_hang_its_group(tmp_path):
    """`test_a_leader_restarted_mid_tournament_plays_the_round_its_followers_wait_for` with
    the job's processes: worker 0, trainer 0's leader, is killed (-9) while it waits in
    round 1's tournament for its partner's model (trainer 1's steps are slowed), after
    its deposit, and psgd run starts it again at once: the coordinator, whose heartbeat
    timeout is longer than the restart, never drops it. The job hung (until psgd run's
    timeout); it now ends, the restarted leader having played round 1 again for its
    follower."""
    sets = ["mode.name=ltfb", "cluster.workers=4", "mode.trainer_size=2", "train.steps=60", "mode.round_steps=20",
            "cluster.heartbeat_s=0.5", "cluster.heartbeat_timeout_s=60", "faults.slow_rank=2",
            "faults.slow_factor=500", f"cluster.port={free_port_block(8)}"]
    j = LocalJob(load(None, sets, env={}), str(tmp_path / "run"), quiet=True, timeout_s=150, restart_workers=True)
    try:
        j.start()
        wait_for_steps(j, 0, 19)             # its next step ends at round 1's tournament
        time.sleep(0.5)                      # in it: scored, deposited, waiting for trainer 1's model
        assert not tournament_lines(j.out, 0), "trainer 1 was not slow enough: round 1 was over"
        child(j, "worker-0").proc.send_signal(signal.SIGKILL)
        s = j.wait()
    finally:
        j.stop()
    story = coordinator_story(j.out) + "\nworker-0's log ends:\n" + log_tail(j.out, "worker-0")
    assert s["failures"]["workers_lost"] == 0 and s["failures"]["workers_restarted"] == 1, story
    assert "playing it again" in log_tail(j.out, "worker-0", 20000), story
    a, b = tournament_lines(j.out, 0), tournament_lines(j.out, 1)
    assert [e["round"] for e in a] == [e["round"] for e in b] == [1, 2], story
    assert same_lines(a, b), story


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_the_coordinator_says_which_registration_took_a_live_rank_over():
    """`taken_back`, which the replay above goes by (its worker's clock could not say: a
    rank whose heartbeats had reported none registers at clock 0, as at the job's
    start): a new process for a rank still counted live is told so, also on its repeat
    to a restarted coordinator; a new process for a rank the job had dropped, one for a
    quiet holder's rank before training, and a first registration are not."""
    import time

    from psgd import wire
    from tests.conftest import ask, closed_after, hand_served
    with closed_after(hand_served(workers=2, **{"mode.name": "ltfb", "train.steps": 100})) as c:
        again = ask(c, "register", role="worker", want_rank=0, nonce="n0-again")   # killed, at once restarted
        assert again.op == "reply" and again.get("taken_back") is True, again.fields
        assert ask(c, "register", role="worker", want_rank=0, nonce="n0-again").get("taken_back") is True  # (a repeat)
        with closed_after(hand_served(workers=2, start=False, **{"mode.name": "ltfb", "train.steps": 100})) as restored:
            restored.members.load_state_dict(c.members.state_dict(), time.monotonic())   # (a restarted coordinator's)
            assert restored.members.members[0].taken_back   # its repeat is told so too
        c.members.members[1].last_seen -= 3600   # rank 1 missed: dropped, then a new process takes it up
        c.members.expire(time.monotonic())
        later = ask(c, "register", role="worker", want_rank=1, nonce="n1-again")
        assert later.op == "reply" and later.get("taken_back") is None, later.fields
    # the rendezvous: rank 0's first process went quiet, another takes its rank
    with closed_after(hand_served(workers=2, start=False, **{"mode.name": "ltfb", "train.steps": 100})) as r:
        r.service._serve(b"w0", wire.encode("register", id=1, role="worker", want_rank=0, nonce="n0"))
        r.members.members[0].last_seen -= 3600
        r.service._serve(b"w0b", wire.encode("register", id=1, role="worker", want_rank=0, nonce="n0-b"))
        assert not r.members.members[0].taken_back and r.phase == "rendezvous"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_push_sent_again_at_a_windows_end_is_not_encoded_again():
    """`group_exchange` sends its push again at each window's end (a restored shard may
    have lost it); a second review found it encoded again, so that a compressed push added
    the gradient to its error-feedback residual a second time. It goes as first encoded:
    the same frames, the residual what one encoding leaves."""
    import types

    from psgd import wire
    from psgd.workers.client import Cancelled, InFlight, ParameterClient
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "mode.trainer_size": 2,
                              "cluster.servers": 1, "wire.compression": "topk", "wire.topk_fraction": 0.1,
                              "cluster.heartbeat_timeout_s": 5.0})
    c = ParameterClient.__new__(ParameterClient)
    c._setup(cfg, 0)
    now, sent, reads = [0.0], [], [0]

    def begin(reqs, cancel=None):
        sent.append(reqs)
        return InFlight(list(reqs), {}, [None] * len(reqs), cancel, {})

    def finish(f):
        if [op for _, op, _ in f.reqs] == ["pull"]:
            reads[0] += 1
            if reads[0] == 1:   # the follower is slow: the first window ends
                now[0] += 6.0
                if f.cancel():
                    raise Cancelled("the window's end")
            return [wire.Message("reply", 1, 0, 0, {"step": 1})]
        return [wire.Message("reply", 1, 0, 0, {"duplicate": len(sent) > 1})]
    c.begin, c.finish = begin, finish
    c.index = lambda: [wire.Message("reply", 1, 0, 0, {"models": [], "outcomes": [[1, 0]], "tags": [[-1, 0, 7]]})]
    g = torch.randn(100)
    notes: list[str] = []
    w = types.SimpleNamespace(clock=3, client=c, now=lambda: now[0], rank=0, note=notes.append,
                              replica=types.SimpleNamespace(n=1, grads=lambda: [g], buffers=lambda: [torch.zeros(0)]))
    s = LtfbSchedule(cfg)
    s.trainer, s.outcome = 0, (-1, 0.5, [[torch.zeros(100)]], 7)
    s.group_exchange(w)
    pushes = [r for r in sent if r[0][1] == "push"]
    assert len(pushes) == 2 and pushes[0] == pushes[1]
    left = g.clone()
    left[g.abs().topk(c._compressors[0].k).indices] = 0
    assert torch.allclose(c._compressors[0].residual, left)
    assert s.outcome is None and not notes, "the outcome, held by the shard, was deposited again"
