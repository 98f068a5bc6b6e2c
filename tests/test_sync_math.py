"""sync mode is exactly large-batch SGD: W workers with batch b produce the same
parameters after k steps as one process with batch W*b (through real sockets)."""
import threading

import pytest
import torch
from torch import nn

from psgd.config import load
from psgd.consistency.rule import Diverged
from psgd.consistency.sync import SyncSchedule
from psgd.inprocess import InProcessCluster
from psgd.models import build_model
from psgd.optim import lr_at, make_optimizer, set_lr
from psgd.replica import OverlapUnsafe, Replica
from psgd.workers.client import ParameterClient, tensors_of
from tests.loopback import FakeTrainer

pytestmark = pytest.mark.inprocess

W, B, K = 3, 8, 6
SGD = ["optimizer.name=sgd", "optimizer.momentum=0.9", "optimizer.nesterov=true", "optimizer.weight_decay=0.001",
       "optimizer.warmup_steps=2"]
ADAMW = ["optimizer.name=adamw", "optimizer.lr=0.01", "optimizer.weight_decay=0.01", "optimizer.schedule=cosine",
         "train.steps=6"]


# hidden=512: each shard's table (~0.6 MB) goes without a copy (above transport.COPY_THRESHOLD), so the
# shards' replies lend their tables (Shard._snapshot) while ZeroMQ reads them
@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_sets,hidden", [(SGD, 128), (ADAMW, 128), (SGD, 512)])
def test_sync_equals_one_process_with_batch_w_times_b(port_block, opt_sets, hidden):
    cfg = load(None, [f"cluster.port={port_block(3)}", f"cluster.workers={W}", "cluster.servers=2",
                      "cluster.evaluator=false", f"model.hidden={hidden}"] + opt_sets, env={})
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(K, W, B, 1, 8, 8, generator=gen)
    ys = torch.randint(0, 10, (K, W, B), generator=gen)
    finals = {}

    def worker(rank, ctx):
        rep = Replica(build_model("mlp", (1, 8, 8), 10, cfg.job.seed, hidden), 2, torch.device("cpu"))
        client = ParameterClient(cfg, ctx, rank)
        msgs = client.request([(i, "pull", {"clock": 0, "join": True}) for i in range(2)])
        rep.load(tensors_of(msgs, 0), tensors_of(msgs, 1))
        versions = [m.get("version") for m in msgs]
        for step in range(K):
            rep.model.zero_grad()
            nn.functional.cross_entropy(rep.model(xs[step, rank]), ys[step, rank]).backward()
            pushed, pulled = client.push_pull(step, rep.grads(), rep.buffers(), versions)
            versions = [m.get("version") for m in pulled]
            rep.load(tensors_of(pulled, 0), tensors_of(pulled, 1))
        finals[rank] = {k: v.clone() for k, v in rep.model.state_dict().items()}
        client.close()

    on_threads(cfg, worker)
    assert len(finals) == W

    assert_one_process_with_batch_w_times_b(cfg, xs, ys, hidden, finals)


def forward(model, x, unused=False):
    """The model's output; `unused`: its last bias taken as a constant, so that backward
    gives that parameter no gradient (its hook never runs)."""
    if not unused:
        return model(x)
    return torch.func.functional_call(model, {"net.5.bias": model.net[5].bias.detach()}, (x,))


def on_threads(cfg, worker):
    """`worker(rank, context)` for each of the W ranks, on threads of this process, against an
    in-process cluster of `cfg`."""
    with InProcessCluster(cfg) as cluster:
        threads = [threading.Thread(target=worker, args=(r, cluster.ctx)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)


def assert_one_process_with_batch_w_times_b(cfg, xs, ys, hidden, finals, unused=False):
    ref = build_model("mlp", (1, 8, 8), 10, cfg.job.seed, hidden)
    opt = make_optimizer(list(ref.parameters()), cfg.optimizer)
    for step in range(K):
        set_lr(opt, lr_at(cfg.optimizer, step, cfg.train.steps))
        opt.zero_grad()
        nn.functional.cross_entropy(forward(ref, xs[step].reshape(W * B, 1, 8, 8), unused),
                                    ys[step].reshape(-1)).backward()
        if unused:   # (the shards step it with a zero gradient, as the worker's tables hold: weight decay still acts)
            ref.net[5].bias.grad = torch.zeros_like(ref.net[5].bias)
        opt.step()
    for rank in range(W):
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(finals[rank][name], value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")
    moved = build_model("mlp", (1, 8, 8), 10, cfg.job.seed, hidden).state_dict()
    assert any(not torch.allclose(moved[k], v) for k, v in ref.state_dict().items())


class OverlapTrainer(FakeTrainer):
    """A worker as psgd's own (its parameters in one block, backward writing into the
    push's tables, hooks on them) computing on the test's batches, noting for each
    request it sends whether backward was still running."""

    def __init__(self, cfg, client, rank, xs, ys, hidden, unused):
        super().__init__(cfg, client, None, rank)
        model = build_model("mlp", (1, 8, 8), 10, cfg.job.seed, hidden)
        self.unused = unused
        self.replica = Replica(model, cfg.cluster.servers, torch.device("cpu"), flat=True, placement=cfg.placement)
        assert self.replica.bind_grads()
        self.replica.hook_backward()
        self.xs, self.ys, self.in_backward, self.sent = xs, ys, False, []
        begin = client.begin
        client.begin = lambda reqs, cancel=None: (self.sent.append((self.clock, [i for i, _, _ in reqs],
                                                                    self.in_backward)), begin(reqs, cancel))[1]

    def compute(self, slot: int = 0) -> float:
        self.replica.clear_grads(slot)
        loss = nn.functional.cross_entropy(forward(self.replica.model, self.xs[self.clock, self.rank], self.unused),
                                           self.ys[self.clock, self.rank])
        self.in_backward = True
        loss.backward()
        self.in_backward = False
        return loss.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_sets,unused", [(SGD, False), (ADAMW, False), (SGD, True)])
def test_sync_with_pushes_from_backward_equals_one_process_with_batch_w_times_b(port_block, opt_sets, unused):
    """wire.overlap: each shard's push leaves from backward's hooks, the last layers' shard
    first, while backward still runs; the steps are sync's, exactly. A shard one of whose
    parameters gets no gradient is sent after backward, its zeros with the rest."""
    hidden = 128   # (the map's two runs: the first layer, and the rest)
    cfg = load(None, [f"cluster.port={port_block(3)}", f"cluster.workers={W}", "cluster.servers=2",
                      "cluster.evaluator=false", f"model.hidden={hidden}", "wire.overlap=true"] + opt_sets, env={})
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(K, W, B, 1, 8, 8, generator=gen)
    ys = torch.randint(0, 10, (K, W, B), generator=gen)
    finals, sent = {}, {}

    def worker(rank, ctx):
        client = ParameterClient(cfg, ctx, rank)
        w = OverlapTrainer(cfg, client, rank, xs, ys, hidden, unused)
        schedule = SyncSchedule(cfg)
        schedule.start(w)
        while w.clock < K:
            schedule.step(w)
        finals[rank] = {k: v.clone() for k, v in w.replica.model.state_dict().items()}
        sent[rank] = w.sent
        client.close()

    on_threads(cfg, worker)
    assert len(finals) == W

    assert_one_process_with_batch_w_times_b(cfg, xs, ys, hidden, finals, unused)
    # after the join's read and the first step's pushes, both after its backward (which learns how often each
    # parameter's hook runs): each step's two pushes, shard 1's first, both within backward (with a parameter
    # of shard 1 given no gradient, shard 0's within it and shard 1's after it)
    order = [(0, True), (1, False)] if unused else [(1, True), (0, True)]
    for rank in range(W):
        assert sent[rank][1:] == [(0, [0, 1], False)] + [(step, [i], within) for step in range(1, K)
                                                         for i, within in order], sent[rank]


def test_warm_up_never_overshoots_the_rate_at_the_fractional_steps_of_ssp_and_async():
    """ssp and async advance the schedule by 1/W per update: the warm-up's last fractional
    steps gave up to lr (1 + (W - 1) / (W warmup)) (W = 4, 2 steps: 1.375 lr); now at most
    lr, rising, and sync's whole steps are unchanged (0.5 lr, then lr)."""
    cfg = load(None, ["optimizer.lr=1.0", "optimizer.warmup_steps=2"]).optimizer
    rates = [lr_at(cfg, v / 4, 100) for v in range(12)]
    assert max(rates) == 1.0 and rates == sorted(rates)
    assert [lr_at(cfg, s, 100) for s in range(3)] == [0.5, 1.0, 1.0]


def test_the_step_and_cosine_schedules_give_their_rates():
    """`optimizer.schedule`: step multiplies by gamma every step_size updates; cosine falls
    from lr to min_lr over the steps after the warm-up (half way: the middle)."""
    step = load(None, ["optimizer.lr=1.0", "optimizer.schedule=step", "optimizer.step_size=10",
                       "optimizer.gamma=0.5"], env={}).optimizer
    assert [lr_at(step, s, 100) for s in (0, 9, 10, 19, 20, 35)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]
    cos = load(None, ["optimizer.lr=1.0", "optimizer.schedule=cosine", "optimizer.min_lr=0.1",
                      "optimizer.warmup_steps=10"], env={}).optimizer
    assert lr_at(cos, 10, 110) == pytest.approx(1.0)
    assert lr_at(cos, 60, 110) == pytest.approx(0.55)      # half way: (1.0 + 0.1) / 2
    assert lr_at(cos, 110, 110) == pytest.approx(0.1) and lr_at(cos, 500, 110) == pytest.approx(0.1)
    assert lr_at(cos, 35, 110) > lr_at(cos, 85, 110)


@pytest.mark.timeout(30)
def test_a_push_that_fails_within_backward_gives_up_those_sent_and_raises_after_it():
    """wire.overlap: a push that cannot be sent (a float16 value out of range, say) is
    raised once backward is done, not from its hook, and the step's pushes already on
    their way are given up (their buffers are the next step's). A shard that had one
    applies it: the step's retry, on the next batch, is its duplicate there (the README's
    `wire.overlap` row says so)."""
    cfg = load(None, ["cluster.servers=2", "model.hidden=128", "wire.overlap=true"], env={})

    class Client:
        wait_s = 0.0

        def __init__(self):
            self.sent, self.abandoned = [], []

        def begin_push_pull(self, clock, grads, buffers, versions, shards=None, into=None):
            if 0 in shards:
                raise Diverged("values up to 1e+09 at step 0 are beyond float16's range")
            self.sent.append(tuple(shards))
            return "shard 1's request"

        def abandon(self, f):
            self.abandoned.append(f)

        def finish_push_pull(self, f):
            raise AssertionError("a step whose push failed waited for the others' answers")

    class Trainer:
        clock = 0

        def __init__(self):
            self.client = Client()
            model = build_model("mlp", (1, 8, 8), 10, 0, 128)
            self.replica = Replica(model, 2, torch.device("cpu"), flat=True, placement=cfg.placement)
            self.replica.bind_grads()
            self.replica.hook_backward()
            self.backward_done = False

        def compute(self, slot=0):
            self.replica.clear_grads(slot)
            self.replica.model(torch.randn(4, 1, 8, 8)).sum().backward()
            self.backward_done = True
            return 0.0

    w = Trainer()
    w.replica.arm(lambda shard: None)   # the first armed backward: how often each hook runs
    w.compute()
    assert w.replica.disarm() == [0, 1]
    schedule = SyncSchedule(cfg)
    schedule.versions = [0, 0]
    with pytest.raises(Diverged, match="float16's range"):
        schedule.step(w)
    assert w.backward_done and w.client.sent == [(1,)] and w.client.abandoned == ["shard 1's request"]
    w.compute()   # disarmed: a backward after the step sends nothing
    assert w.client.sent == [(1,)]


class SharedTwice(nn.Module):
    """One layer used twice, each time in a reentrant activation checkpoint: its hook runs
    twice in a backward, once for each use's part of its gradient. `again`: the second
    use only from the step it is set (a graph that changes)."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.again = True

    def block(self, h):
        return torch.relu(self.shared(h))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, torch.relu(self.inp(x)), use_reentrant=True)
        if self.again:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


def backward_sending(replica, model, x, y):
    """One armed backward: what each shard's push would carry as it leaves, then the
    shards left for after it."""
    sent = {}
    replica.clear_grads(0)
    replica.arm(lambda i: sent.setdefault(i, replica.grads(shards=(i,))[0].clone()))
    nn.functional.cross_entropy(model(x), y).backward()
    return sent, replica.disarm()


@pytest.mark.timeout(60)
def test_pushes_from_backward_wait_for_every_part_of_a_gradient_made_in_parts():
    """wire.overlap with a layer used in two reentrant checkpoints: its gradient comes in
    two parts, and its shard's push left after the first (accuracy 0.9248 against 0.9471
    without overlap, in a job of 100 steps). How often each hook runs is learned from the
    first backward, whose pushes leave after it; from then on each push leaves once its
    shard's gradients are whole, still within backward."""
    torch.manual_seed(0)
    model = SharedTwice()
    replica = Replica(model, 2, torch.device("cpu"), flat=True, placement="layers")
    assert replica.bind_grads()
    replica.hook_backward()
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    assert backward_sending(replica, model, x, y) == ({}, [0, 1])
    for _ in range(2):
        sent, rest = backward_sending(replica, model, x, y)
        assert sorted(sent) == [0, 1] and rest == [], (sorted(sent), rest)
        for i, g in sent.items():
            torch.testing.assert_close(g, replica.grads(shards=(i,))[0], rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_gradient_in_more_parts_than_learned_after_its_push_left_ends_the_step():
    """A model whose graph changes (a layer used once in the first backward, twice
    later): its shard's push left with part of the gradient; that is said, naming the
    parameter, not trained on."""
    torch.manual_seed(0)
    model = SharedTwice()
    model.again = False
    replica = Replica(model, 2, torch.device("cpu"), flat=True, placement="layers")
    assert replica.bind_grads()
    replica.hook_backward()
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    backward_sending(replica, model, x, y)
    assert sorted(backward_sending(replica, model, x, y)[0]) == [0, 1]
    model.again = True
    with pytest.raises(OverlapUnsafe, match=r"shared\.(weight|bias)'s gradient was accumulated more often "
                                            r".* wire.overlap = false"):
        backward_sending(replica, model, x, y)
