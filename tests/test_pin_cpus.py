"""`cluster.pin_cpus`: psgd run puts each shard and worker, with all its threads, on a CPU
of its own where they fit (psgd/launcher.py `cpu_places`, psgd/forkserver.py `take_cpu`),
and otherwise pins nothing and says why."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from psgd.config import CPU_ENV, load
from psgd.launcher import cpu_places, one_a_core_first, run_local


def cfg_of(*sets: str):
    return load(None, ["cluster.pin_cpus=true", *sets], env={})


@pytest.mark.unit
def test_shards_then_workers_each_get_a_cpu_of_their_own():
    places, said = cpu_places(cfg_of("cluster.servers=2", "cluster.workers=2", "cluster.evaluator=false"),
                              cpus=[3, 5, 6, 9, 11])
    assert places == {"server-0": 3, "server-1": 5, "worker-0": 6, "worker-1": 9}
    assert said == "cluster.pin_cpus: shards and workers on CPUs 3, 5, 6, 9, one each"


@pytest.mark.unit
def test_the_evaluator_gets_a_cpu_where_one_is_left_and_is_said_unpinned_where_none_is():
    """The evaluator computes too (each score): pinned where a CPU is left after the shards
    and workers; where none is, they are pinned and it takes turns with them, as said."""
    sets = ("cluster.servers=1", "cluster.workers=1", "cluster.evaluator=true")
    places, said = cpu_places(cfg_of(*sets), cpus=[4, 7, 8])
    assert places == {"server-0": 4, "worker-0": 7, "evaluator-0": 8}
    assert said == "cluster.pin_cpus: shards, workers and the evaluator on CPUs 4, 7, 8, one each"
    places, said = cpu_places(cfg_of(*sets), cpus=[4, 7])
    assert places == {"server-0": 4, "worker-0": 7}
    assert said.endswith("CPUs 4, 7, one each; the evaluator is not pinned: no CPU is left for it, so it takes "
                         "turns with them")


@pytest.mark.unit
@pytest.mark.parametrize("sets, kw, says", [
    (["cluster.servers=2", "cluster.workers=2"], {"cpus": [0, 1, 2]},
     "2 shards and 2 workers on 3 CPUs: each needs a CPU of its own; nothing is pinned"),
    (["cluster.servers=1", "cluster.workers=1"], {"cpus": [0, 1], "script": True},
     "a training script's workers are not pinned, so neither are the shards"),
    (["cluster.servers=1", "cluster.workers=1"], {"cpus": [0, 1], "threads": "2"},
     "OMP_NUM_THREADS=2: a process that computes on several threads is not pinned"),
    (["cluster.servers=1", "cluster.workers=1", "data.loader_workers=2"], {"cpus": [0, 1, 2, 3]},
     "data.loader_workers > 0: a worker's loader processes would share its CPU; nothing is pinned"),
])
def test_where_they_do_not_each_fit_on_one_cpu_nothing_is_pinned_and_it_is_said(sets, kw, says):
    places, said = cpu_places(cfg_of(*sets), **kw)
    assert places == {}
    assert says in said


@pytest.mark.unit
def test_cores_of_their_own_first_then_their_second_threads(tmp_path):
    """Two hardware threads a core, listed as siblings (0/1, 2/3: some VMs and AMD) or as
    halves (0-3 then 4-7: Intel): pinned processes take one thread of each core first."""
    def topology(cores: dict[int, int]) -> str:
        root = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        for cpu, core in cores.items():
            (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
            (root / f"cpu{cpu}" / "topology" / "physical_package_id").write_text("0\n")
            (root / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{core}\n")
        return str(root)
    assert one_a_core_first([0, 1, 2, 3], topology({0: 0, 1: 0, 2: 1, 3: 1})) == [0, 2, 1, 3]
    assert one_a_core_first([0, 1, 2, 3], topology({0: 0, 1: 1, 2: 0, 3: 1})) == [0, 1, 2, 3]
    assert one_a_core_first([1, 2, 3], topology({1: 0, 2: 1, 3: 1})) == [1, 2, 3]
    assert one_a_core_first([0, 1], str(tmp_path / "none")) == [0, 1]   # (no topology: as given)


@pytest.mark.unit
def test_off_by_default():
    assert cpu_places(load(None, [], env={}), cpus=list(range(64))) == ({}, "")


def affinity_after_take_cpu(cpu: str) -> subprocess.CompletedProcess:
    code = "import os; from psgd.forkserver import take_cpu; take_cpu(); print(sorted(os.sched_getaffinity(0)))"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, CPU_ENV: cpu}, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_daemon_takes_the_cpu_it_is_given_and_says_when_it_cannot():
    mine = sorted(os.sched_getaffinity(0))
    got = affinity_after_take_cpu(str(mine[-1]))
    assert got.stdout.strip() == str([mine[-1]]), got.stderr
    beyond = affinity_after_take_cpu("100000")   # no such CPU: said, and it runs where it may
    assert beyond.stdout.strip() == str(mine)
    assert "could not pin this process to CPU 100000 (cluster.pin_cpus)" in beyond.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_psgd_run_pins_its_shard_and_worker_with_all_their_threads(port_block, tmp_path):
    cpus = one_a_core_first(sorted(os.sched_getaffinity(0)))
    cfg = load(None, [f"cluster.port={port_block(2)}", "cluster.pin_cpus=true", "cluster.workers=1",
                      "cluster.servers=1", "cluster.evaluator=false", "train.steps=0", "train.seconds=4"], env={})
    seen: dict[str, set] = {}

    def watch() -> None:   # each daemon's threads' CPUs, from its pid file, while the job trains
        end = time.monotonic() + 60
        while time.monotonic() < end and len(seen) < 2:
            for name in ("server-0", "worker-0"):
                path = tmp_path / "pids" / f"{name}.pid"
                try:
                    pid = int(path.read_text().split()[0])
                    tasks = os.listdir(f"/proc/{pid}/task")
                    if len(tasks) >= 3:   # (its ZeroMQ threads started)
                        seen[name] = {frozenset(os.sched_getaffinity(int(t))) for t in tasks}
                except (OSError, ValueError, IndexError):
                    pass
            time.sleep(0.1)
    t = threading.Thread(target=watch)
    t.start()
    try:
        run_local(cfg, str(tmp_path), quiet=True)
    finally:
        t.join()
    assert seen == {"server-0": {frozenset({cpus[0]})}, "worker-0": {frozenset({cpus[1]})}}
