"""The benchmarks' command lines (bench/): a bad flag value is a one-line usage error
(exit 2) before anything starts, not a traceback, a silent run of nothing, or a crash
after minutes of runs. What the benchmarks measure is never asserted here."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

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
    for parse, text in ((int_list(1), "0"), (int_list(1), "1,x"), (int_list(1), ""), (name_list(("a",)), "a,c"),
                        (number(int, 1), "0"), (number(int, 1), "1.5"), (number(float, 0, above=True), "0"),
                        (number(float, 0, above=True), "nan"), (parse_size, "0"), (parse_size, "64Q"),
                        (parse_size, ""), (parse_size, "4")):
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
    ("throughput", ["--device", "gpu"], "--device"),
    ("scaling", ["--models", "mlp,foo"], "--models"),          # crashed after mlp's runs
    ("scaling", ["--modes", "sync,bogus"], "--modes"),
    ("scaling", ["--models", "mlp", "--modes", "sync", "--workers", "1", "--shards", "1,70000"], "S=70000"),
    ("control", ["--beats", "0"], "--beats"),
    ("control", ["--heartbeat-s", "0"], "--heartbeat-s"),
    ("control", ["--live", "0.5"], "--live"),
]


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench,args,named", BAD, ids=[f"{b}-{' '.join(a)}" for b, a, _ in BAD])
def test_bad_flag_is_a_usage_error(tmp_path, bench: str, args: list[str], named: str) -> None:
    keep = [] if bench == "control" else ["--keep", str(tmp_path / "keep")]
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
