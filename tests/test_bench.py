"""The benchmarks' command lines (bench/): a bad flag value is a one-line usage error
(exit 2) before anything starts, not a traceback, a silent run of nothing, or a crash
after minutes of runs. What the benchmarks measure is never asserted here."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bench.common import int_list, name_list, number
from bench.transport import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.unit
def test_flag_types() -> None:
    assert int_list(1)("1,2,4") == [1, 2, 4]
    assert name_list(("a", "b"))("b,a") == ["b", "a"]
    assert number(float, 0, above=True)("0.5") == 0.5
    assert parse_size("64K") == 64 << 10 and parse_size("16MiB") == 16 << 20 and parse_size("100") == 96
    from bench.transport import digits, label
    assert [label(n) for n in (96, 1000, 64 << 10, 1572864, 16 << 20)] == ["96 B", "1000 B", "64 KiB", "1.5 MiB",
                                                                            "16 MiB"]
    assert digits(0.0000403) == 4.03e-05 and digits(4.60524) == 4.6052
    for parse, text in ((int_list(1), "0"), (int_list(1), "1,x"), (int_list(1), ""), (name_list(("a",)), "a,c"),
                        (number(int, 1), "0"), (number(int, 1), "1.5"), (number(float, 0, above=True), "0"),
                        (number(float, 0, above=True), "nan"), (parse_size, "0"), (parse_size, "64Q"),
                        (parse_size, ""), (parse_size, "4"), (parse_size, "1e400K"), (parse_size, "65G"),
                        (number(int, 1024, maximum=65535), "65536")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


BAD = [
    ("transport", ["--sizes", "64Q"], "--sizes"),
    ("transport", ["--sizes", "0"], "--sizes"),
    ("transport", ["--shards", "0"], "--shards"),
    ("transport", ["--workers", "-1"], "--workers"),
    ("transport", ["--repeats", "0"], "--repeats"),
    ("throughput", ["--parts", "nonsense"], "--parts"),       # ran nothing and exited 0
    ("throughput", ["--models", "foo"], "--models"),
    ("throughput", ["--repeats", "0"], "--repeats"),
    ("throughput", ["--steps-scale", "0.05"], "--steps-scale"),
    ("throughput", ["--parts", "overlap", "--steps-scale", "0.2"], "--steps-scale"),   # ResNet-20: 8 steps ran
    ("throughput", ["--device", "gpu"], "--device"),
    ("throughput", ["--parts", "ddp", "--backend", "bogus"], "--backend"),   # failed after the plain loop's runs
    ("throughput", ["--parts", "ddp", "--backend", "nccl"], "--backend"),    # NCCL on the CPU (or none in torch)
    ("scaling", ["--models", "mlp,foo"], "--models"),          # crashed after mlp's runs
    ("scaling", ["--modes", "sync,bogus"], "--modes"),
    ("scaling", ["--models", "mlp", "--modes", "sync", "--workers", "1", "--shards", "1,70000"], "S=70000"),
    ("control", ["--beats", "0"], "--beats"),
    ("control", ["--heartbeat-s", "0"], "--heartbeat-s"),
    ("control", ["--live", "0.5"], "--live"),
    ("lane", ["--bytes", "0"], "--bytes"),
    ("lane", ["--spin-us", "0"], "--spin-us"),
    ("lane", ["--port", "70000"], "--port"),                     # ZeroMQ bound port 4464 instead
    ("transport", ["--sizes", "infK"], "--sizes"),               # OverflowError's traceback
    ("transport", ["--sizes", "1e30K"], "--sizes"),              # psgd's ConfigError's, with processes started
    ("scaling", ["--quick", "--models", "resnet20"], "--quick"),  # ran the mlp without a word
    ("busy", ["--busy", "0"], "--busy"),
    ("busy", ["--repeats", "0"], "--repeats"),
    ("busy", ["--busy", "100000"], "--busy"),                   # as many interpreters started
]


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench,args,named", BAD, ids=[f"{b}-{' '.join(a)}" for b, a, _ in BAD])
def test_bad_flag_is_a_usage_error(tmp_path, bench: str, args: list[str], named: str) -> None:
    keep = [] if bench in ("control", "lane", "busy") else ["--keep", str(tmp_path / "keep")]
    r = subprocess.run([sys.executable, "-m", f"bench.{bench}", *args, *keep], cwd=REPO, capture_output=True,
                       text=True, timeout=50, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and named in r.stderr.splitlines()[-1], r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "keep").exists()   # nothing ran


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_throughput_cuda_without_a_gpu_says_so() -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, "-m", "bench.throughput", "--parts", "local", "--device", "cuda"], cwd=REPO,
                       capture_output=True, text=True, timeout=50, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 2 and "no CUDA device" in r.stderr.splitlines()[-1], r.stderr


# One GPU as torch sees it, with NCCL: what the checks of --device and --backend look at.
ONE_GPU = ("import torch\nimport torch.distributed as dist\ntorch.cuda.is_available = lambda: True\n"
           "torch.cuda.device_count = lambda: 1\ndist.is_nccl_available = lambda: True\n")


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,said", [
    (["--device", "cuda:1"], "--device cuda:1: torch sees 1 CUDA device here (cuda:0)"),
    (["--device", "cuda", "--backend", "nccl"], "--backend nccl takes a GPU per DDP rank: --workers 2 on 1 GPU"),
    (["--device", "cuda:0", "--backend", "nccl", "--workers", "2"], "--workers 2 on 1 GPU"),
    # (the phases part's workers, and the floor it times alone, ran on the CPU, in a JSON that said "device": "cuda")
    (["--device", "cuda", "--workers", "1", "--parts", "phases"], "--parts phases times a step on the CPU only"),
])
def test_throughput_device_or_backend_this_machine_cannot_run_is_a_usage_error(args, said) -> None:
    """A review: `--device cuda:1` on a machine of one GPU, or DDP with NCCL and more ranks
    than GPUs (NCCL refuses two ranks on one GPU), started the benchmark; each part then
    failed in turn, after the runs before it."""
    r = _main_with("throughput", ONE_GPU, [*args, "--parts", "ddp,local", "--models", "mlp"]
                   if "--parts" not in args else args)
    assert r.returncode == 2 and said in r.stderr.splitlines()[-1], r.stderr
    assert r.stdout == "" and "[bench]" not in r.stderr


def _main_with(module: str, patch: str, args: list[str], timeout: float = 50) -> subprocess.CompletedProcess:
    """`python -m bench.MODULE ARGS` with `patch` (code run on the module, as `m`) applied first."""
    code = f"import sys\nimport bench.{module} as m\n{patch}\nsys.argv = ['{module}', *{args!r}]\nm.main()\n"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO})


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_busy_on_one_core_says_there_is_nothing_to_compare() -> None:
    """On one core `psgd run` spins no job: the two sides would be the same job."""
    r = _main_with("busy", "import psgd.launcher\npsgd.launcher.available_cores = lambda: 1", [])
    assert r.returncode == 2 and "nothing to compare" in r.stderr.splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr and "[bench]" not in r.stderr


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_throughput_part_that_fails_leaves_the_others_measured() -> None:
    """A failing part (here the DDP baseline, as NCCL failing on a GPU machine) used to end
    the benchmark with a traceback, the later parts not run and nothing printed."""
    patch = ("def boom(*a, **k):\n    raise RuntimeError('baseline rank 0: no NCCL')\n"
             "m.run_loops = boom\nm.startup = lambda work, device: (1.5, 3.0, 1.4)\n")
    r = _main_with("throughput", patch, ["--parts", "ddp,startup", "--models", "mlp"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "ddp mlp failed: RuntimeError: baseline rank 0: no NCCL" in r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["failed"] == {"ddp mlp": "RuntimeError: baseline rank 0: no NCCL"}
    assert out["startup_s"] == 1.5 and "ratio_vs_ddp_small" not in out


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_throughput_pins_a_baseline_only_where_psgds_processes_are_pinned() -> None:
    """`--pin-cpus` on two CPUs: psgd's W = 1 S = 1 jobs fit (one CPU each), so the plain
    loop is pinned too; psgd's W = 2 S = 1 job does not (three processes), so DDP's two
    ranks are not (pinned against psgd unpinned, DDP had an edge of its own). The plain
    loop goes on the CPU of psgd's worker (a review: it took the first CPU of the order,
    where psgd puts its shard)."""
    patch = ("import os, sys\nos.sched_getaffinity = lambda pid: {0, 1}\n"
             "def loops(sets, world, steps, device, backend, warmup, pin=None):\n"
             "    print('baseline', world, pin, file=sys.stderr)\n    return 100.0\n"
             "def ours(sets, work, name, warmup, device):\n"
             "    print('psgd', name, 'cluster.pin_cpus=true' in sets, file=sys.stderr)\n    return 50.0\n"
             "m.run_loops, m.psgd_rate = loops, ours\n")
    r = _main_with("throughput", patch, ["--parts", "ddp,local", "--models", "mlp", "--repeats", "1", "--pin-cpus"])
    assert r.returncode == 0, r.stdout + r.stderr
    said = {line for line in r.stderr.splitlines() if line.startswith(("baseline", "psgd "))}
    assert said == {"baseline 2 None", "baseline 1 [1]", "psgd vs_ddp_small True", "psgd vs_local True"}, said
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["pin_cpus"] is True and got["pinned"] == {"vs_ddp_small": False, "vs_local": True}, got


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag, flushed", [([], True), (["--no-flush-denormal"], False)])
def test_throughput_flushes_denormals_on_both_sides_or_on_neither(flag, flushed) -> None:
    """Its baselines and psgd's jobs take one config, so one `train.flush_denormal`: the
    plain loop computed on denormals that psgd's shorter runs never reached."""
    patch = ("import sys\n"
             "def loops(sets, world, steps, device, backend, warmup, pin=None):\n"
             "    print('baseline', 'train.flush_denormal=false' not in sets, file=sys.stderr)\n    return 100.0\n"
             "def ours(sets, work, name, warmup, device):\n"
             "    print('psgd', 'train.flush_denormal=false' not in sets, file=sys.stderr)\n    return 50.0\n"
             "m.run_loops, m.psgd_rate = loops, ours\n")
    r = _main_with("throughput", patch, ["--parts", "local", "--models", "mlp", "--repeats", "1", *flag])
    assert r.returncode == 0, r.stdout + r.stderr
    said = {line for line in r.stderr.splitlines() if line.startswith(("baseline", "psgd "))}
    assert said == {f"baseline {flushed}", f"psgd {flushed}"}, said
    assert json.loads(r.stdout.splitlines()[-1])["flush_denormal"] is flushed


# Each side's step rows as steady_rate times them: (rank, rows, the step its window opens
# after, its last step), printed under the side's name (run_loops's steady_rate is the
# baseline's, bench.common's the one run_psgd calls for psgd's jobs).
WINDOWS = ("import sys\nimport bench.common as c\nreal = c.steady_rate\n"
           "def told(side):\n    def rate(runs, warmup):\n"
           "        print(side, sorted((r, len(rows), rows[warmup - 1]['step'], rows[-1]['step'])\n"
           "                           for r, rows in runs.items()), warmup, file=sys.stderr)\n"
           "        return real(runs, warmup)\n    return rate\n"
           "m.steady_rate, c.steady_rate = told('baseline'), told('psgd')\n")


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_throughput_plain_loop_times_the_steps_psgd_times() -> None:
    """A review: the plain loop that `ratio_vs_local` and `ratio_async_vs_local` divide by
    went on past psgd's steps for a second (3,400 steps against psgd's 600), and was timed
    over all of them: a window of other work (its warm-up a smaller share of it, a model
    trained further). Both sides now run the same steps and are timed over the same ones.
    (A real run, a tenth of the steps: what is compared is which steps, never a speed.)"""
    r = _main_with("throughput", WINDOWS, ["--parts", "local", "--repeats", "1", "--steps-scale", "0.1"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in r.stderr.splitlines()
            if line.startswith(("baseline ", "psgd "))}
    assert set(said) == {"baseline", "psgd"}, r.stderr
    assert said["baseline"] == said["psgd"] == "[(0, 60, 50, 60)] 50", said


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_throughput_startup_runs_on_the_benchmarks_device() -> None:
    """A review: the startup part ran `psgd run` with its default --device (auto: the GPU
    where there is one), whatever the benchmark's --device, which its JSON names."""
    patch = ("def start(self, name, argv, env=None):\n    raise RuntimeError('argv: ' + ' '.join(argv))\n"
             "m.Procs.start = start\n")
    r = _main_with("throughput", patch, ["--parts", "startup", "--device", "cpu"])
    assert r.returncode == 1 and " run --out " in r.stderr, r.stdout + r.stderr
    assert "--device cpu" in r.stderr.split("startup failed: RuntimeError: argv: ")[1].splitlines()[0], r.stderr


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_throughput_on_a_gpu_runs_every_part_but_phases_by_default() -> None:
    """(--parts phases with a GPU --device is a usage error: the default leaves it out.)"""
    patch = ONE_GPU + ("def boom(*a, **k):\n    raise RuntimeError('not run here')\n"
                       "m.run_loops = m.startup = m.phases = boom\n")
    r = _main_with("throughput", patch, ["--device", "cuda", "--workers", "1"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert set(json.loads(r.stdout.splitlines()[-1])["failed"]) == {"ddp mlp", "ddp resnet20", "local,async",
                                                                     "overlap", "startup"}, r.stdout


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_scaling_point_that_fails_leaves_the_others_measured() -> None:
    patch = ("def fake(sets, out, warm):\n    if 'mode.name=async' in sets:\n        raise RuntimeError('boom')\n"
             "    return {'steady': 100.0, 'wait_fraction': 0.25}\nm.run_psgd = fake\n")
    r = _main_with("scaling", patch, ["--quick", "--modes", "sync,async,ssp", "--workers", "1"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "mlp async W=1 S=1 failed: RuntimeError: boom" in r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert [(p["mode"], p["samples_per_s"]) for p in out["rows"]] == [("sync", 100.0), ("ssp", 100.0)]
    assert out["failed"] == [{"model": "mlp", "mode": "async", "workers": 1, "shards": 1,
                              "error": "RuntimeError: boom"}]


@pytest.mark.processes
@pytest.mark.timeout(90)
@pytest.mark.parametrize("group", [False, True], ids=["sigterm", "ctrl-c"])
def test_control_stopped_during_live_leaves_no_sender(group: bool) -> None:
    """SIGTERM during `--live` ended the benchmark at once, and its heartbeat sender went on
    beating at a dead coordinator for the rest of the --live seconds. And a terminal's
    Ctrl-C (SIGINT to the whole process group) or a SIGTERM ends it with one line, not a
    traceback from it and another from each child."""
    from tests.conftest import children
    started: set[int] = set()
    p = subprocess.Popen([sys.executable, "-m", "bench.control", "--workers", "2", "--beats", "20", "--live", "60"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, start_new_session=group,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # (not a shell's SIG_IGN)
    try:
        assert p.stderr is not None
        for line in p.stderr:   # the sender starts right after this line
            if "the whole coordinator on its socket" in line:
                break
        deadline = time.monotonic() + 30
        while not children(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        started = children(p.pid)
        assert started
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.terminate()
        assert p.wait(timeout=20) == (130 if group else 143)
        said = p.stderr.read()
        assert "Traceback" not in said and said.strip().endswith(
            f"[bench] stopped ({'Ctrl-C' if group else 'SIGTERM'}); the processes it started are stopped"), said
        deadline = time.monotonic() + 10
        while (left := {c for c in started if os.path.exists(f"/proc/{c}")}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"left running after the benchmark ended: {left}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        for c in started:   # what a failed check found still running
            with contextlib.suppress(OSError):
                os.kill(c, signal.SIGKILL)


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_control_live_window_serves_only_the_beats_sent_within_it() -> None:
    """A review: `--live`'s heartbeat sender began beating as soon as its interpreter was up
    (0.85 s before the timed window opened, on an idle machine) while the coordinator slept
    out a fixed second, so the window served a backlog on top of its W / heartbeat_s a
    second (11,972 beats in 5 s at 1,024 workers, not 10,240), more or less of it as the
    machine started a process faster or slower. Now the sender beats only once the window
    opens, and for its length: at most rate x window (+1) beats are served, whatever the
    start took. (A count, never a speed.)"""
    code = ("import zmq\nimport bench.control as m\nfrom psgd.servers.coordinator import Coordinator\n"
            "served, real = [], Coordinator.on_heartbeat\n"
            "def on_heartbeat(self, ident, msg):\n    served.append(msg.rank)\n    return real(self, ident, msg)\n"
            "Coordinator.on_heartbeat = on_heartbeat\nctx = zmq.Context()\n"
            "m.live_share(256, 2.0, 0.5, ctx)\nctx.term()\nprint(len(served))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=80,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stdout + r.stderr
    served = int(r.stdout.split()[-1])
    assert 0 < served <= 256 / 0.5 * (2.0 - 1.0) + 1, served   # 512 a second, over the 1 s window


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_scaling_starts_each_point_in_a_fresh_folder(tmp_path) -> None:
    """A --keep folder holding an interrupted run's point (its checkpoints) made psgd resume
    that job instead of running the point."""
    stale = tmp_path / "keep" / "mlp-sync-w1-s1" / "checkpoints"
    stale.mkdir(parents=True)
    (stale / "shard-0.pt").write_text("an interrupted run's")
    patch = ("import os\ndef fake(sets, out, warm):\n    assert not os.path.exists(os.path.join(out, 'checkpoints'))\n"
             "    return {'steady': 100.0, 'wait_fraction': 0.25}\nm.run_psgd = fake\n")
    r = _main_with("scaling", patch, ["--quick", "--modes", "sync", "--workers", "1", "--keep", str(tmp_path / "keep")])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_transport_starts_each_point_in_a_fresh_folder(tmp_path) -> None:
    """psgd resumed an interrupted --keep run's job from its checkpoint (the shard answering
    its pushes as duplicates: a shard busy 157 ms a push, psgd/raw far above its ceiling),
    and the wait for the daemons read their earlier logs."""
    point = tmp_path / "keep" / "psgd-64K-1"
    (point / "checkpoints").mkdir(parents=True)
    (point / "checkpoints" / "stale").write_text("an interrupted run's")   # psgd itself neither reads nor writes it
    r = subprocess.run([sys.executable, "-m", "bench.transport", "--sizes", "64K", "--shards", "1", "--workers", "1",
                        "--repeats", "1", "--seconds", "0.2", "--keep", str(tmp_path / "keep")], cwd=REPO,
                       capture_output=True, text=True, timeout=110, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (point / "checkpoints" / "stale").exists()


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_gpu_sh_names_a_python_without_torch_not_a_missing_gpu(tmp_path) -> None:
    """With no .venv at the checkout's root, gpu.sh takes python3; one without torch made
    it say "no usable GPU" and exit 2, the code it documents for no GPU."""
    (tmp_path / "notorch").mkdir()
    (tmp_path / "notorch" / "torch.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    py = tmp_path / "py"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'notorch'}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu.sh")], capture_output=True, text=True, timeout=50,
                       env={**os.environ, "OUT": str(tmp_path / "out"), "PY": str(py),
                            "GPU_WHEELS": str(tmp_path / "no-wheels")})
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "cannot import torch" in r.stderr and "no usable GPU" not in r.stderr, r.stderr


@contextlib.contextmanager
def _script(code: str) -> Iterator[tuple[subprocess.Popen, set[int]]]:
    """`python -c code`, which prints "started" when it is under way, and a set of its
    processes for the test to fill: each is killed at the end, as the script is."""
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": REPO})
    pids: set[int] = set()
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "started"
        yield p, pids
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        for c in pids:
            with contextlib.suppress(OSError):
                os.kill(c, signal.SIGKILL)


def _running(pids: set[int], within: float = 10) -> set[int]:
    """Those of `pids` still running (zombies are not) after up to `within` seconds."""
    from psgd.metrics import proc_stat
    deadline = time.monotonic() + within
    while (left := {c for c in pids if (proc_stat(c) or "Z")[0] != "Z"}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_throughput_stopped_during_a_baseline_stops_its_ranks_at_once() -> None:
    """A review: SIGTERM (or Ctrl-C) while the plain loop or DDP ranks ran ended the
    benchmark only after it had waited 10 s for each rank to finish by itself (22 s at W =
    2), ranks still training; `timeout --kill-after=5` (bench/gpu.sh) then killed the
    benchmark and left its ranks running on."""
    from tests.conftest import children
    code = ("import bench.throughput as m\nfrom bench.common import stop_on_signals\nstop_on_signals()\n"
            "print('started', flush=True)\n"
            "m.run_loops(m.MODELS['mlp'][0] + m.COMMON, 2, 10 ** 9, 'cpu', None, 50)\n")
    with _script(code) as (p, ranks):
        deadline = time.monotonic() + 60
        while len(ranks) < 2 and time.monotonic() < deadline:   # the two ranks (spawn's resource tracker aside)
            ranks |= {c for c in children(p.pid) if "multiprocessing.spawn" in _cmdline(c)}
            time.sleep(0.2)
        assert len(ranks) == 2, children(p.pid)
        time.sleep(1.0)
        p.terminate()
        t = time.monotonic()
        p.wait(timeout=30)
        took = time.monotonic() - t
        assert not (left := _running(ranks)), f"ranks left running: {left}"
        assert took < 8, f"the benchmark took {took:.1f} s to stop after SIGTERM"


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_busy_stopped_leaves_no_busy_process(sig: int) -> None:
    """bench.busy's processes that only compute end with it, stopped during a job beside
    them (SIGTERM: it stops them; SIGKILL: they see it gone)."""
    from tests.conftest import children
    # (its jobs, faked: the idle ones (4 at --repeats 1) done at once, the first beside the busy ones held)
    code = ("import itertools, sys, time\nimport bench.busy as m\njobs = itertools.count(1)\n"
            "def job(*a, **k):\n    if next(jobs) <= 4:\n        return {'steady': 1.0}\n"
            "    print('started', flush=True)\n    time.sleep(60)\n"
            "m.run_psgd = job\nsys.argv = ['busy', '--busy', '2', '--repeats', '1']\nm.main_of(m.main)\n")
    with _script(code) as (p, busy):
        busy |= {c for c in children(p.pid) if "getppid" in _cmdline(c)}
        assert len(busy) == 2, children(p.pid)
        p.send_signal(sig)
        assert p.wait(timeout=20) == (128 + sig if sig == signal.SIGTERM else -sig)
        assert not (left := _running(busy)), f"busy processes left running: {left}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_control_times_a_look_over_every_worker_whatever_the_clock_reads(monkeypatch) -> None:
    """A review: the scan's loop set the last look to `now - CHECK_EVERY_S`, and `now - that`
    falls short of CHECK_EVERY_S in floating point for many `now` (every one between 2**13
    and 2**15 s of uptime): no look was made, and `scan_us` read 0.5 us at any W. (A count of
    looks, never a speed.)"""
    import zmq

    import bench.control as m
    from psgd.membership import Membership
    looks = []
    real = Membership.expire
    monkeypatch.setattr(Membership, "expire", lambda self, now: looks.append(now) or real(self, now))
    monkeypatch.setattr(m.time, "monotonic", lambda: 10000.3)   # (10000.3 - (10000.3 - 0.05) < 0.05)
    ctx = zmq.Context()
    try:
        m.measure(4, 10, False, ctx)
    finally:
        ctx.term()
    assert len(looks) == 200, len(looks)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_control_runs_below_its_baseline_worker_count() -> None:
    """`--workers 1` measured W = 1, then failed on W = 2's figures, not yet measured
    (KeyError: (2, 'steady')), with no table and no JSON."""
    r = subprocess.run([sys.executable, "-m", "bench.control", "--workers", "1", "--beats", "20", "--live", "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(json.loads(r.stdout.splitlines()[-1])["scan_us"]) == {"1", "2"}, r.stdout


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_lane_on_a_port_in_use_says_so_in_a_line_and_leaves_no_echo() -> None:
    """A port already bound: two tracebacks after a 30 s wait (the echo's ZMQError, then
    "the zmq echo process did not start")."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.Popen([sys.executable, "-m", "bench.lane", "--steps", "10", "--repeats", "1", "--port",
                              str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": REPO})
        try:
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert p.returncode == 1 and "Traceback" not in err, err
    mine = f"bench.lane --steps 10 --repeats 1 --port {port}"   # (an echo left behind: the benchmark's command line)
    left = [d for d in os.listdir("/proc") if d.isdigit() and _cmdline(int(d)).rstrip().endswith(mine)]
    assert not left, left
    assert err.splitlines()[-1] == (f"bench.lane: error: the zmq echo process did not start (exit code 1; is port "
                                    f"{port} in use? --port picks another)"), err
