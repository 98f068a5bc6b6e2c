"""The `psgd` command line in this process, for what it decides before starting anything
(tests/test_cli_e2e.py runs it as real processes)."""
from __future__ import annotations

import contextlib
import json
import os

import pytest

from psgd.cli import main
from psgd.consistency import PARAMS

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv,suggestion", [
    (["run", "--set", "train.steps", "100"], "--set train.steps=100"),
    (["run", "--set", "train.steps", "=", "100"], "--set train.steps=100"),
    (["run", "--set", "train.steps", "=100"], "--set train.steps=100"),
    (["compare", "--modes", "sync", "--set", "mode.staleness", "3", "--out", "x"], "--set mode.staleness=3"),
    (["worker", "--set", "train.steps"], "--set train.steps=VALUE"),
    (["worker", "--set=train.steps", "--rank", "1"], "--set train.steps=VALUE"),
])
def test_set_with_a_space_for_the_equals_sign_says_so(argv, suggestion, capsys):
    """It used to take the value for the CONFIG argument: "config file 100 does not exist"."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "expected SECTION.KEY=VALUE" in err and suggestion in err, err
    assert "does not exist" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("cmd,item", [(["run"], ["--set", "cluster.workers=3"]),
                                      (["compare", "--modes", "sync"], ["--set", "cluster.workers=3"]),
                                      (["run"], ["--set=cluster.workers=3"])])
def test_two_items_after_one_set_say_each_needs_its_own(cmd, item, capsys):
    """A review: `--set a=1 b=2` made b=2 the CONFIG argument: "config file b=2 does not exist"."""
    assert main([*cmd, *item, "cluster.servers=3", "--set", "train.steps=20"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("psgd: error: --set cluster.workers=3 cluster.servers=3: each --set takes one "
                           "SECTION.KEY=VALUE; did you mean --set cluster.workers=3 --set cluster.servers=3?"), err


def test_a_config_file_whose_name_has_an_equals_sign_still_follows_a_set(tmp_path, monkeypatch):
    from psgd.cli import check_sets
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr=0.1.toml").write_text("[train]\nsteps = 10\n")
    check_sets(["run", "--set", "train.steps=5", "lr=0.1.toml"])   # (raises if taken for a second item)


def test_set_with_a_space_after_a_config_file(tmp_path, capsys):
    """With a CONFIG the value used to be an unrecognized argument."""
    config = tmp_path / "job.toml"
    config.write_text("[train]\nsteps = 10\n")
    assert main(["run", str(config), "--set", "train.steps", "100"]) == 2
    assert "did you mean --set train.steps=100?" in capsys.readouterr().err


def test_a_missing_value_is_not_taken_from_an_existing_file(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text("")
    assert main(["run", "--set", "train.steps", str(config)]) == 2
    assert "did you mean --set train.steps=VALUE?" in capsys.readouterr().err



class NoJob:
    """What `psgd run` passed to run_local, and what the job writes (`during`: functions of DIR)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.during: list = []


@pytest.fixture
def no_job(monkeypatch):
    """`psgd run` without a job: run_local returns a summary at once; main's SIGTERM
    handler is put back afterwards."""
    import signal
    import time

    import psgd.launcher
    import psgd.metrics
    job = NoJob()
    summary = {"mode": "sync", "final_accuracy": 0.5, "final_loss": 1.0, "samples_per_s": 100.0, "wall_s": 1.0,
               "time_to_target_s": None, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0}}

    def run_local(cfg, out, **kw):
        job.calls.append({"cfg": cfg, "out": out, **kw})
        kw["announce"]()
        for write in job.during:
            write(out)
        return summary

    monkeypatch.setattr(psgd.launcher, "run_local", run_local)
    monkeypatch.setattr(psgd.metrics, "process_start_time", time.time)  # this command started now
    handler = signal.getsignal(signal.SIGTERM)
    yield job
    signal.signal(signal.SIGTERM, handler)


def refused_before_start(argv: list[str], says: str, capsys, no_job: NoJob) -> None:
    """`psgd argv` is refused with `says`, in one line on stderr (no traceback) and exit
    code 2, before any job starts (`no_job`)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert no_job.calls == []


def test_arguments_after_the_double_dash_are_the_scripts_not_checked_as_psgds(tmp_path, no_job, capsys):
    """`-- --set large` used to be refused as psgd's own malformed --set."""
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["run", "--script", str(script), "--out", str(tmp_path / "out"), "--set", "train.steps=3",
            "--", "--set", "large"]
    assert main(argv) == 0, capsys.readouterr().err
    assert no_job.calls[0]["script"] == [str(script), "--set", "large"]
    assert no_job.calls[0]["cfg"].train.steps == 3
    # psgd's own --set before the -- is still checked
    assert main(argv[:-5] + ["--set", "train.steps", "3", "--", "--set", "large"]) == 2
    assert "did you mean --set train.steps=3?" in capsys.readouterr().err


def test_run_names_the_final_model_only_when_it_was_saved(tmp_path, no_job, capsys):
    """It used to print `model: DIR/model.pt` when rank 0 had saved none."""
    script = tmp_path / "train.py"
    script.write_text("")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["run", "--script", str(script), "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "model:" not in captured.out and f"summary: {out}/summary.json" in captured.out
    assert f"warning: no final model was saved ({out}/model.pt: rank 0 did not write it; {out}/logs/worker-0.log" \
        in captured.err
    (out / "model.pt").write_bytes(b"x")
    os.utime(out / "model.pt", (1e9, 1e9))   # an earlier job's, in the same folder
    assert main(argv) == 0
    assert "model:" not in capsys.readouterr().out
    no_job.during.append(lambda d: open(os.path.join(d, "model.pt"), "wb").close())   # rank 0 saves it
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"model: {out}/model.pt" in captured.out and "warning" not in captured.err


@pytest.mark.timeout(120)
def test_the_psgd_command_imports_a_factory_from_the_folder_it_runs_in(tmp_path):
    # as `python -m psgd` does: the console script did not see the folder's modules
    import subprocess
    import sys
    (tmp_path / "mymodels_cwd.py").write_text(
        "from torch import nn\n"
        "def model(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    psgd = os.path.join(os.path.dirname(sys.executable), "psgd")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([psgd, "shards", "--set", "model.name=mymodels_cwd:model"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=100)
    assert got.returncode == 0, got.stderr
    assert "cannot import" not in got.stderr


@pytest.mark.timeout(120)
def test_output_into_a_closed_pipe_ends_quietly():
    """`psgd shards | head -1`: the reader gone, psgd said "error: [Errno 32] Broken pipe"
    and exited 1. It ends as a Unix tool killed by SIGPIPE does: nothing said, 141."""
    import subprocess
    import sys
    read, write = os.pipe()
    os.close(read)   # no reader at all: the first write fails, every time
    try:
        got = subprocess.run([sys.executable, "-m", "psgd", "shards", "--servers", "4"], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=100)
    finally:
        os.close(write)
    assert got.returncode == 141 and got.stderr == "", got.stderr


def test_a_time_limit_longer_than_the_platform_can_wait_is_the_longest_it_can():
    """A review: `psgd status DIR --watch 1e308` printed its first table, then time.sleep's
    OverflowError."""
    import threading

    from psgd.cli import _seconds
    assert _seconds("1e308") == threading.TIMEOUT_MAX and _seconds("2.5") == 2.5


@pytest.mark.parametrize("argv,needle", [
    (["run", "--timeout", "nan"], "argument --timeout: expected a number of seconds > 0, got 'nan'"),
    (["compare", "--modes", "sync", "--timeout", "0", "--out", "x"], "expected a number of seconds > 0, got '0'"),
    (["run", "--device", "bogus"], "--device 'bogus' is not a device"),
    (["run", "--set", "security.curve=true", "--set", "security.keys=/nonexistent"],
     "security.keys: /nonexistent/server.key_secret not found"),
])
def test_what_would_fail_every_daemon_is_one_error_before_anything_starts(argv, needle, tmp_path, capsys):
    """A bad --device or missing CurveZMQ keys started the job, whose daemons then died with
    a traceback each; --timeout nan meant no limit at all."""
    try:
        code = main([*argv, "--out", str(tmp_path / "job")] if "--out" not in argv else argv)
    except SystemExit as e:   # argparse's own errors
        code = e.code
    assert code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "job" / "logs").exists()


def test_cuda_on_a_machine_without_it_is_one_error(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["run", "--device", "cuda", "--out", str(tmp_path / "job")]) == 2
    assert "--device cuda: CUDA is not available on this machine" in capsys.readouterr().err


@pytest.mark.parametrize("content,needle", [(b"# caf\xe9\n", "is not UTF-8 text"), (None, "Is a directory")])
def test_a_config_file_that_cannot_be_read_is_one_line(content, needle, tmp_path, capsys):
    path = tmp_path / "job.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("sets,says", [
    (["job.seed=-1"], "job.seed must be in 0..4294967295, got -1"),
    (["job.seed=99999999999999999999"], "job.seed must be below 2**62 in magnitude"),
    (["cluster.port=0"], "cluster.port must be in 1..65532 (the coordinator's; the shards take the next 2), got 0"),
    (["checkpoint.dir=/proc/psgd-not-here"], "checkpoint.dir = '/proc/psgd-not-here' cannot be written"),
    (["cluster.host=psgd-no-such-host.invalid"], "cluster.host = 'psgd-no-such-host.invalid' does not resolve here"),
    (["data.name=synthetic", "data.classes=-3"], "data.classes must be 0 (the dataset's own) or >= 2, got -3"),
])
def test_values_that_failed_every_daemon_after_the_start_are_one_error_before_it(tmp_path, no_job, capsys, sets,
                                                                                   says):
    """A review: a negative seed crashed every worker (the job aborted as 'all workers were
    lost'); a seed past 64 bits crash-looped the shards; port 0 waited cluster.timeout_s
    for a coordinator at port 0; an unwritable checkpoint.dir was a traceback in a shard's
    log and a job without checkpoints."""
    argv = ["run", "--out", str(tmp_path / "out")]
    for s in sets:
        argv += ["--set", s]
    refused_before_start(argv, says, capsys, no_job)


@pytest.mark.parametrize("item,says", [
    ("train.steps=inf", "--set train.steps=inf: train.steps: expected an integer, got inf"),
    ("train.steps=1e20", "train.steps must be below 2**62 in magnitude"),
    ("eval.batch_size=1e30", "got 1000000000000000019884624838656 (1e+30)"),   # (the int it was read as, and so)
    ("cluster.max_rejections=99999999999999999999", "cluster.max_rejections must be below 2**62 in magnitude"),
    ("mode.staleness=1e20", "mode.staleness must be below 2**62 in magnitude"),
])
def test_an_integer_that_is_inf_or_past_64_bits_is_one_error_before_the_job_starts(tmp_path, no_job, capsys, item,
                                                                                     says):
    """A review: train.steps=inf was a traceback (OverflowError); train.steps=1e20 started the
    job, whose coordinator could not send the config (msgpack: Integer value out of range),
    and every worker died with a traceback."""
    refused_before_start(["run", "--out", str(tmp_path / "out"), "--set", item], says, capsys, no_job)


@pytest.mark.parametrize("name,says", [
    ("foo", "model.name 'foo': expected mlp, cnn, resnet20 or package.module:factory"),
    ("nosuchpkg_psgd_test.mod:factory", "model.name 'nosuchpkg_psgd_test.mod:factory': cannot import"),
    ("psgd.models:no_such_factory", "psgd.models has no callable 'no_such_factory'"),
])
def test_a_bad_model_name_is_one_error_before_the_job_starts(tmp_path, no_job, capsys, name, says):
    """A review: the job started, its evaluator died on the name and was restarted five times,
    and psgd run ended with exit 1 and seven lines (the README promises one line and exit 2)."""
    refused_before_start(["run", "--out", str(tmp_path / "out"), "--set", f"model.name={name}"], says, capsys, no_job)


def not_a_module(input_shape, num_classes):
    return 42


def float64_model(input_shape, num_classes):
    import torch
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes)).double()


def raising_factory(input_shape, num_classes):
    raise RuntimeError("no weights file here")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,says", [
    (f"{__name__}:not_a_module", "the factory returned int, not nn.Module"),
    (f"{__name__}:raising_factory", "the factory raised RuntimeError: no weights file here"),   # (was a traceback)
    ("tests.test_data_models:no_parameters", "the model has no trainable parameters"),
    (f"{__name__}:float64_model", "trainable parameters must be float32, got torch.float64"),
])
def test_a_model_factory_no_worker_can_use_is_one_error_before_the_job_starts(tmp_path, no_job, capsys, name, says):
    """A review: the factory was only imported. The job started: with a model that is not
    a Module or is float64 every worker exited 2 and the evaluator was restarted five
    times; with no trainable parameter every worker died with a wire traceback and the
    job waited cluster.timeout_s."""
    refused_before_start(["run", "--out", str(tmp_path / "out"), "--set", f"model.name={name}"], says, capsys, no_job)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,says", [
    (["--workers", "3"], "worker 2: its data partition is empty (3 workers, 2 training samples"),
    (["--workers", "2", "--mode", "ltfb", "--set", "mode.tournament_fraction=0.5"],
     "worker 1: its data partition (1 sample) is all held out for the mode's tournaments"),
])
def test_more_workers_than_the_training_set_has_samples_for_is_one_error_before_the_job_starts(tmp_path, no_job,
                                                                                                 capsys, argv, says):
    """A review: psgd run --workers 3 on 2 training samples trained with one worker and
    exited 0 (workers 1 and 2 stopped: their partitions were empty); psgd simulate
    refused it."""
    data = ["--set", "data.name=synthetic", "--set", "data.classes=2", "--set", "data.samples=2",
            "--set", "data.shape=[4]"]
    refused_before_start(["run", "--out", str(tmp_path / "out"), *data, *argv], says, capsys, no_job)
    assert main(["run", "--out", str(tmp_path / "out"), *data, "--workers", "2"]) == 0


@pytest.mark.timeout(60)
def test_compare_checks_the_partitions_of_the_worker_counts_it_runs():
    """psgd compare checks its plan's worker counts, not the config's."""
    from psgd.cli import check_job
    from psgd.config import ConfigError, load
    base = load(None, ["data.name=synthetic", "data.classes=2", "data.samples=3", "data.shape=[4]",
                       "cluster.workers=4"], env={})
    with pytest.raises(ConfigError, match="4 workers, 3 training samples"):
        check_job(base)
    check_job(base, [base.replace(**{"cluster.workers": w}) for w in (1, 3)])


def test_a_jobs_own_config_toml_run_again_leaves_the_port_to_psgd_run(tmp_path, no_job, capsys):
    """A helper's review: `psgd run DIR/config.toml` (the job run again from its resolved
    config) took the port that the earlier run had chosen as the user's own: with another
    job on that block it was refused ("set another cluster.port, or leave it unset"), which
    that file gives no way to do. A file of the user's that names cluster.port still pins it."""
    from psgd.config import Config
    written = tmp_path / "config.toml"
    written.write_text(Config().replace(**{"cluster.port": 21234}).to_toml())
    assert main(["run", str(written), "--out", str(tmp_path / "again")]) == 0, capsys.readouterr().err
    assert no_job.calls[-1]["port_explicit"] is False
    mine = tmp_path / "mine.toml"
    mine.write_text("[cluster]\nport = 21234\n")
    assert main(["run", str(mine), "--out", str(tmp_path / "mine")]) == 0, capsys.readouterr().err
    assert no_job.calls[-1]["port_explicit"] is True


def test_a_checkpoint_dir_that_is_a_file_is_one_error(tmp_path, no_job, capsys):
    (tmp_path / "ckpt").write_text("")
    assert main(["run", "--out", str(tmp_path / "out"), "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]) == 2
    assert "cannot be written" in capsys.readouterr().err and no_job.calls == []


@pytest.mark.parametrize("argv,says", [
    (["--mode", "sync", "--set", "mode.name=async"], "--set mode.name=async and --mode sync disagree: give one"),
    (["--workers", "3", "--set", "cluster.workers=4"], "--set cluster.workers=4 and --workers 3 disagree"),
    (["--script", "SCRIPT", "--set", "cluster.evaluator=true"],
     "--set cluster.evaluator=true and --script (a script's job runs no evaluator) disagree"),
])
def test_a_flag_and_a_set_of_its_key_that_disagree_are_an_error(tmp_path, no_job, capsys, argv, says):
    """A review: the flag won without a word."""
    script = tmp_path / "train.py"
    script.write_text("")
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    assert main(["run", "--out", str(tmp_path / "out"), *argv]) == 2
    assert says in capsys.readouterr().err and no_job.calls == []
    agree = [a.replace("async", "sync").replace("=4", "=3").replace("=true", "=false") for a in argv]
    assert main(["run", "--out", str(tmp_path / "out"), *agree]) == 0   # the same value twice is fine


@pytest.mark.parametrize("flag,value,says", [
    ("--workers", "0", "--workers 0: cluster.workers must be >= 1, got 0"),
    ("--servers", "-1", "--servers -1: cluster.servers must be >= 1, got -1"),
    ("--mode", "bogus", "--mode bogus: mode.name must be one of"),
])
def test_a_bad_flag_value_is_named_as_the_flag_given(tmp_path, no_job, capsys, flag, value, says):
    """It was named as a `--set cluster.workers=0` the user never typed."""
    assert main(["run", "--out", str(tmp_path / "out"), flag, value]) == 2
    assert says in capsys.readouterr().err and no_job.calls == []


@pytest.mark.parametrize("verb", [["run"], ["compare", "--modes", "sync"], ["simulate", "--modes", "sync"]])
def test_an_output_folder_that_is_a_file_is_one_error(tmp_path, no_job, capsys, verb):
    """It was an errno ("[Errno 20] Not a directory: '.../logs'"), after `psgd run` had announced the job."""
    (tmp_path / "out").write_text("")
    assert main([*verb, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'out'} is a file, not a folder" in err
    assert "psgd run: psgd, mode" not in err and no_job.calls == []


@pytest.mark.parametrize("verb", [["run"], ["compare", "--modes", "sync"], ["simulate", "--modes", "sync"]])
@pytest.mark.parametrize("from_env", [False, True])
@pytest.mark.timeout(60)
def test_an_output_folder_that_cannot_be_made_is_one_error(tmp_path, no_job, capsys, monkeypatch, verb, from_env):
    """`psgd run --out /proc/x` (or PSGD_OUT=/proc/x, or under a file) was "psgd run: error:
    No such file or directory: /proc/x", exit 1, after the job's checks, naming neither
    --out nor the variable. (Not a daemon's --out: the daemons of a job start at once into
    one folder, and one that cannot write there exits 73 naming the file.)"""
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "sub" / "out")
    if from_env:
        monkeypatch.setenv("PSGD_OUT", out)
    assert main([*verb, *([] if from_env else ["--out", out])]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot make this folder: Not a directory" in err, err
    assert (f"($PSGD_OUT={out})" in err) == from_env, err
    assert len(err.strip().splitlines()) == 1 and no_job.calls == []
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.parametrize("verb", [["run"], ["compare", "--modes", "sync"]])
@pytest.mark.timeout(60)
def test_an_output_folder_that_cannot_be_written_in_is_one_error(no_job, capsys, verb):
    """A review: a folder that exists but cannot be written in (here /sys/fs, which even
    root cannot; a read-only mount) passed the check, and the job failed later with "psgd
    compare: error: Operation not permitted: /sys/fs/runs", exit 1."""
    if not os.path.isdir("/sys/fs") or _writable("/sys/fs"):
        pytest.skip("needs a folder that cannot be written in: /sys/fs")
    assert main([*verb, "--out", "/sys/fs"]) == 2
    err = capsys.readouterr().err
    assert "--out /sys/fs: cannot write in this folder" in err, err
    assert len(err.strip().splitlines()) == 1 and no_job.calls == []


def _writable(folder: str) -> bool:
    probe = os.path.join(folder, f".psgd-test-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    os.rmdir(probe)
    return True


@pytest.mark.timeout(60)
def test_the_output_folder_check_leaves_nothing_behind(tmp_path, no_job, capsys):
    """The folders made to see that --out can be made are removed again when the command
    stops before it writes there (a config error)."""
    assert main(["run", "--out", str(tmp_path / "a" / "b"), "--set", "train.steps=ten"]) == 2
    assert "train.steps: expected an integer" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_shard_daemon_sees_no_gpu(tmp_path, monkeypatch):
    """A shard computes on the CPU; on a GPU machine torch's Adam step asked for the current
    CUDA stream and opened a context on GPU 0 in every shard (a helper's review)."""
    import os
    import signal

    from psgd.servers import shard_server
    seen = []
    monkeypatch.setattr(shard_server.ShardServer, "run", lambda self: seen.append(os.environ.get(
        "CUDA_VISIBLE_DEVICES")) or 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")   # (restored after the test)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["server", "--shard", "0", "--out", str(tmp_path / "out")]) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [""]


def test_a_request_too_large_for_any_peer_ends_a_daemon_with_one_line(tmp_path, monkeypatch, capsys):
    """A register whose layout's header passes 1 MiB: its refusal came back with no request
    id, and the worker resent it until it gave up on the coordinator."""
    import signal

    from psgd import wire
    from psgd.workers import worker as worker_mod

    def too_large(self, model):
        wire.encode("register", role="worker", layout=[["t" * 100, "params", [4]]] * 20_000)
    monkeypatch.setattr(worker_mod.Worker, "join", too_large)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["worker", "--out", str(tmp_path / "out")]) == 1
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert "psgd worker: error: too_large: register: a header of" in err and "Traceback" not in err


@pytest.mark.parametrize("rank", ["-5", "2"])
def test_a_worker_rank_outside_the_job_is_one_error(tmp_path, capsys, rank):
    """A helper's review: `psgd worker --rank -5` waited out cluster.timeout_s for a
    coordinator, then said "worker 0 could not register"."""
    import signal
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["worker", "--rank", rank, "--out", str(tmp_path / "out"), "--set", "cluster.timeout_s=2"]) == 2
    finally:
        signal.signal(signal.SIGTERM, before)
    assert f"--rank {rank} is out of range: cluster.workers = 2 (ranks 0..1" in capsys.readouterr().err


def test_a_job_that_timed_out_says_where_its_checkpoints_are(tmp_path, no_job, capsys):
    """A helper's review: "the job did not finish within 8 s" (psgd run --timeout) did not
    say that a psgd run into the same --out resumes from the shards' checkpoints, as an
    interrupted job's message does."""
    from psgd.config import Config
    from psgd.launcher import LaunchError

    def checkpointed_then_timed_out(out: str) -> None:
        for i in range(2):
            path = Config().checkpoint_file(out, i)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()
        raise LaunchError("the job did not finish within 8 s")
    no_job.during.append(checkpointed_then_timed_out)
    assert main(["run", "--out", str(tmp_path / "out"), "--timeout", "8"]) == 1
    assert ("the job did not finish within 8 s; the shards' checkpoints are in "
            f"{tmp_path / 'out' / 'checkpoints'} (a psgd run into the same --out resumes from them)") \
        in capsys.readouterr().err


def test_a_job_with_its_own_checkpoint_dir_says_a_run_with_that_dir_resumes(tmp_path, no_job, capsys):
    """With checkpoint.dir set, an interrupted job said "a psgd run into the same --out
    resumes from them": one into the same --out without checkpoint.dir starts afresh, and
    one into another --out with the same checkpoint.dir resumes."""
    from psgd.launcher import LaunchError
    ckpt = tmp_path / "ckpt"

    def checkpointed_then_timed_out(out: str) -> None:
        ckpt.mkdir(exist_ok=True)
        for i in range(2):
            open(ckpt / f"shard-{i}.pt", "wb").close()
        raise LaunchError("the job did not finish within 8 s")
    no_job.during.append(checkpointed_then_timed_out)
    assert main(["run", "--out", str(tmp_path / "out"), "--timeout", "8", "--set", f"checkpoint.dir={ckpt}"]) == 1
    assert (f"the shards' checkpoints are in {ckpt} (a psgd run with the same checkpoint.dir resumes from them)"
            in capsys.readouterr().err)


@pytest.mark.parametrize("what,says", [("missing.py", "no such file"), ("", "a folder, not a Python file")])
def test_a_script_that_is_no_file_is_one_error(tmp_path, no_job, capsys, what, says):
    """A helper's review: `--script DIR` said "no such file" of a folder that exists."""
    refused_before_start(["run", "--out", str(tmp_path / "out"), "--script", str(tmp_path / what)],
                         f"--script {tmp_path / what}: {says}", capsys, no_job)


def test_a_scripts_argument_given_before_the_double_dash_says_where_it_goes(tmp_path, no_job, capsys):
    """`psgd run --script train.py --workers 2 32` said "config file 32 does not exist":
    the script's argument, given without `--`, was taken as psgd's CONFIG."""
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    refused_before_start(["run", "--out", str(tmp_path / "out"), "--script", str(script), "32"],
                         f"config file 32 does not exist (arguments for the script go after --: psgd run "
                         f"--script {script} [options] -- 32)", capsys, no_job)


def test_shards_takes_no_output_folder(capsys):
    """`psgd shards` writes nothing: its help promised events/, pids/ and summary.json in --out."""
    with pytest.raises(SystemExit):
        main(["shards", "--help"])
    assert "--out" not in capsys.readouterr().out


def test_the_run_summary_line_says_nothing_of_a_target_nothing_scored():
    from psgd.launcher import format_summary
    s = {"mode": "sync", "final_accuracy": None, "final_loss": None, "samples_per_s": 8000.0, "wall_s": 0.4,
         "time_to_target_s": None, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0}}
    assert "target" not in format_summary(s) and "no evaluation" in format_summary(s)
    scored = {**s, "final_accuracy": 0.5, "final_loss": 1.0, "evals": [{"t": 0.3, "accuracy": 0.5}]}
    assert "target 0.9 not reached" in format_summary(scored)
    assert "  0.25 samples/s  " in format_summary({**s, "samples_per_s": 0.25})   # a big model: was "0 samples/s"


def test_a_simulated_runs_summary_line_gives_virtual_seconds_and_no_start_up():
    """`psgd status` of a `psgd simulate` run printed "wall 0.0 s ... start-up 0.0 s": its
    virtual wall was 0.023 s, rounded to tenths, and a simulation starts no process."""
    from psgd.launcher import format_summary
    s = {"mode": "sync", "final_accuracy": 0.93, "final_loss": 0.2, "samples_per_s": 112611.0, "wall_s": 0.0227,
         "time_to_target_s": 0.0114, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0},
         "startup_s": 0.0, "simulated": True}
    line = format_summary(s)
    assert "wall 0.023 virtual s" in line and "time to 0.9: 0.011 virtual s" in line, line
    assert "start-up" not in line, line
    real = format_summary({**s, "simulated": False})
    assert "wall 0.0 s" in real and "start-up 0.0 s" in real and "virtual" not in real, real


def test_the_run_summary_line_says_a_job_went_on_without_a_lost_worker():
    """A review: a worker died mid-training, the job went on with the other and ended
    "accuracy 1.0000 ...": only summary.json's failures said one was lost."""
    from psgd.launcher import format_summary
    s = {"mode": "sync", "final_accuracy": 1.0, "final_loss": 0.1, "samples_per_s": 800.0, "wall_s": 4.0,
         "time_to_target_s": 1.0, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0}, "workers": 2}
    assert "lost" not in format_summary({**s, "failures": {"workers_lost": 0, "workers_gone": 0}})
    assert format_summary({**s, "failures": {"workers_lost": 1, "workers_gone": 1}}).endswith("  1 worker lost (of 2)")
    # replaced (lost and back), while another rank's quick restart counted a rejoin without a loss
    back = {"workers_lost": 1, "workers_rejoined": 1, "workers_gone": 0}
    assert "lost" not in format_summary({**s, "failures": back})
    assert "1 worker lost" in format_summary({**s, "failures": {"workers_lost": 1, "workers_rejoined": 1,
                                                                "workers_gone": 1}})


def test_the_run_summary_line_claims_no_staleness_that_the_mode_does_not_record():
    """`psgd run --mode ltfb` ended "staleness mean 0.00 max 0", while ltfb's independent
    trainers count none (summary.json's staleness.hist is empty; README: "none in ltfb")."""
    from psgd.launcher import format_summary
    from psgd.metrics import summarize
    final = {"t": 1.0, "samples": 64, "accuracy": 0.95, "loss": 0.2, "final": True}
    ltfb = summarize(mode="ltfb", mode_params={}, workers=2, servers=1, wall_s=1.0, worker_stats={},
                     server_stats={}, evals=[final], target=0.9, failures={}, final_expected=True)
    assert ltfb["staleness"]["hist"] == {}
    line = format_summary(json.loads(json.dumps(ltfb)))
    assert "staleness" not in line and "accuracy 0.9500" in line, line
    # a mode that counts it, all at 0 (sync), keeps its measured 0
    sync = {**ltfb, "mode": "sync", "staleness": {"mean": 0.0, "max": 0, "hist": {"0": 40}}}
    assert "  staleness mean 0.00 max 0" in format_summary(sync)


def test_the_run_summary_line_says_easgds_staleness_is_in_exchanges_not_updates():
    """A soak of easgd (2 workers) ended "staleness mean 1.00 max 51", the same words as
    async's updates, though each of easgd's is another worker's exchange of tau steps."""
    from psgd.launcher import format_summary
    from psgd.metrics import summarize
    final = {"t": 1.0, "samples": 64, "accuracy": 0.95, "loss": 0.2, "final": True}
    s = summarize(mode="easgd", mode_params={}, workers=2, servers=1, wall_s=1.0, worker_stats={},
                  server_stats={}, evals=[final], target=0.9, failures={}, final_expected=True)
    easgd = {**s, "staleness": {"mean": 1.0, "max": 51, "hist": {"1": 40, "32+": 1}}}
    assert "  staleness mean 1.00 max 51 (centre moves between exchanges)" in format_summary(easgd)
    line = format_summary({**easgd, "mode": "async"})
    assert "staleness mean 1.00 max 51" in line and "exchanges" not in line, line


def test_a_final_loss_that_is_not_finite_is_said_not_left_out():
    """A diverged diloco run (mode.outer_lr = 50) ended "accuracy 0.1031" with no loss and
    summary.json's final_loss null, as if no score had come: the evaluator's loss was NaN."""
    from psgd.launcher import format_summary
    from psgd.metrics import json_line, summarize
    final = {"t": 1.0, "samples": 64, "accuracy": 0.1031, "loss": float("nan"), "final": True}
    s = summarize(mode="diloco", mode_params={}, workers=2, servers=1, wall_s=1.0, worker_stats={}, server_stats={},
                  evals=[final], target=0.9, failures={}, final_expected=True)
    written = json.loads(json_line(s))
    assert written["final_loss"] is None and written["final_loss_not_finite"] is True
    assert "final_eval_missing" not in written
    line = format_summary(written)
    assert "accuracy 0.1031  loss not finite (the model diverged)" in line, line
    from psgd.compare import _one_line
    assert _one_line(written).startswith("acc 0.1031 (loss not finite: the model diverged), ")
    fine = summarize(mode="sync", mode_params={}, workers=1, servers=1, wall_s=1.0, worker_stats={}, server_stats={},
                     evals=[{**final, "loss": 2.5}], target=0.9, failures={}, final_expected=True)
    assert "final_loss_not_finite" not in fine and "loss 2.5000" in format_summary(fine)
    # a review: a score restored by a restarted coordinator has its NaN loss as its files wrote it, null
    restored = summarize(mode="diloco", mode_params={}, workers=2, servers=1, wall_s=1.0, worker_stats={},
                         server_stats={}, evals=[json.loads(json_line(final))], target=0.9, failures={},
                         final_expected=True)
    assert restored["final_loss_not_finite"] is True and "final_eval_missing" not in restored


@pytest.mark.timeout(60)
def test_the_summary_adds_up_the_workers_and_shards_counters_as_the_readme_says():
    """Each summary.json field from known counters: sums over the workers (samples, bytes,
    waits, refused steps) and the shards' bad messages, the largest clock gap and dropped
    count of a shard (README: "the most that any shard left out"), the first score at or
    above the target, and no final score when the evaluator's final one never came."""
    from psgd.metrics import summarize
    workers = {0: {"samples": 300, "elapsed_s": 10.0, "wait_s": 2.0, "bytes_sent": 1000, "bytes_recv": 2000,
                   "rejected": 1, "staleness_hist": [2, 1], "staleness_sum": 1, "staleness_max": 1, "retries": 2},
               1: {"samples": 100, "elapsed_s": 6.0, "wait_s": 2.0, "bytes_sent": 500, "bytes_recv": 500,
                   "rejected": 2, "staleness_hist": [0, 0, 1], "staleness_sum": 2, "staleness_max": 2}}
    shards = {0: {"max_clock_gap": 3, "dropped": 4, "bad_messages": 1, "busy_s": 1.0},
              1: {"max_clock_gap": 1, "dropped": 2, "bad_messages": 5, "busy_s": 0.5}}
    evals = [{"t": 1.0, "samples": 10, "accuracy": 0.5, "loss": 1.0},
             {"t": 2.0, "samples": 20, "accuracy": 0.9, "loss": 0.5},       # at the target: reached
             {"t": 3.0, "samples": 30, "accuracy": 0.95, "loss": 0.4},
             {"t": 4.0, "samples": 40, "accuracy": 0.85, "loss": 0.6}]      # during training: not final
    s = summarize(mode="sync", mode_params={}, workers=2, servers=2, wall_s=8.0, worker_stats=workers,
                  server_stats=shards, evals=evals, target=0.9, failures={}, final_expected=True)
    assert (s["samples"], s["samples_per_s"], s["time_to_target_s"]) == (400, 50.0, 2.0)
    assert s["staleness"] == {"mean": 0.75, "max": 2, "hist": {"0": 2, "1": 1, "2": 1}}
    assert (s["wait_fraction"], s["bytes_per_sample"]) == (0.25, 10.0)   # 4 s of 16; 4000 bytes / 400
    assert (s["max_clock_gap"], s["dropped_gradients"], s["bad_messages"], s["rejected"]) == (3, 4, 6, 3)
    assert s["resends"] == 2   # (a helper found 11 of 12 pushes of a 100 MB model sent twice: seen only in bytes)
    assert s["shard_busy_fraction"] == [0.125, 0.0625]
    assert s["final_accuracy"] is None and s["final_loss"] is None and s["final_eval_missing"] is True
    final = summarize(mode="sync", mode_params={}, workers=2, servers=2, wall_s=8.0, worker_stats=workers,
                      server_stats=shards, evals=[*evals, {**evals[-1], "t": 5.0, "final": True}], target=0.9,
                      failures={}, final_expected=True)
    assert (final["final_accuracy"], final["final_loss"]) == (0.85, 0.6) and "final_eval_missing" not in final


def test_an_interrupted_checkpoint_leaves_no_temp_file(tmp_path, monkeypatch):
    import torch

    from psgd.shard import write_checkpoint

    def save(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint({"x": torch.zeros(1)}, str(tmp_path / "shard-0.pt"))
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verb,slow", [("compare", "psgd.compare.context"), ("simulate", "psgd.simulate.compute_cost")])
def test_an_interrupt_while_a_comparison_gets_ready_says_so(verb, slow, tmp_path, capsys, monkeypatch, no_job):
    """A review: Ctrl-C in the second or two psgd compare takes to import torch (psgd
    simulate: to calibrate) after making OUT ended it with exit 130 and not a word."""
    import importlib

    def interrupted(*args, **kw):
        raise KeyboardInterrupt
    module, name = slow.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    argv = [verb, "--modes", "sync", "--workers", "2", "--out", str(tmp_path / "out"), "--set", "train.steps=5"]
    assert main(argv + (["--no-baseline"] if verb == "compare" else [])) == 130
    err = capsys.readouterr().err
    assert f"psgd {verb}: interrupted before its first run: nothing ran, no report written" in err, err


@pytest.mark.parametrize("var,value,argv,says", [
    ("PSGD_CONFIG", "missing.toml", ["shards"], "config file missing.toml does not exist ($PSGD_CONFIG=missing.toml)"),
    ("PSGD_DEVICE", "gpu", ["run"], "--device 'gpu' is not a device: expected auto, cpu, cuda or cuda:N "
                                    "($PSGD_DEVICE=gpu)"),
    ("PSGD_OUT", "a-file", ["run"], "--out a-file is a file, not a folder ($PSGD_OUT=a-file)"),
])
def test_a_bad_value_from_a_psgd_variable_names_the_variable(tmp_path, monkeypatch, no_job, capsys, var, value,
                                                              argv, says):
    """A helper's review: `PSGD_DEVICE=gpu psgd run` said "--device 'gpu' is not a device",
    a flag the user never typed; $PSGD_CONFIG's missing file and $PSGD_OUT's file alike."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(var, value)
    refused_before_start(argv, says, capsys, no_job)
    flag = {"PSGD_DEVICE": ["--device", value], "PSGD_OUT": [f"--out={value}"], "PSGD_CONFIG": [value]}[var]
    assert main(argv + flag) == 2
    assert f"(${var}=" not in capsys.readouterr().err   # typed on the command line: nothing to add


@pytest.mark.timeout(60)
@pytest.mark.parametrize("refusal", ["folder held", "folder held, port in the ephemeral range", "port taken",
                                     "late config error"])
def test_a_refused_run_says_only_its_refusal(tmp_path, capsys, monkeypatch, refusal):
    """A helper's review: a run refused by the launcher (its output folder held by another
    job's launcher, its cluster.port taken, a config error found there) printed the job's
    announcement and its port choice before the refusal. Now the refusal alone, one line;
    nor does it offer to resume from the checkpoints in that folder (the running job's)."""
    import fcntl

    from psgd import launcher, scalars
    from psgd.config import ConfigError
    from tests.conftest import free_port_block, listening_on
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    for i in range(2):   # the running job's, as it writes them every checkpoint.every_s
        (out / "checkpoints" / f"shard-{i}.pt").write_bytes(b"")
    port = free_port_block(3)
    argv = ["run", "--out", str(out)]
    with contextlib.ExitStack() as held:
        if refusal.startswith("folder held"):   # another launcher's lock (flock: per open file, so here too)
            lock = held.enter_context(open(out / ".launcher.lock", "w"))
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if refusal.endswith("range"):   # (its warning, said for a job that starts)
                monkeypatch.setattr(launcher, "in_ephemeral_range", lambda base, n: True)
                argv += ["--set", f"cluster.port={port}"]
        elif refusal == "port taken":
            held.enter_context(listening_on(port + 1))
            argv += ["--set", f"cluster.port={port}"]
        else:
            def late(cfg):
                raise ConfigError("eval.tensorboard = true needs the tensorboard package")
            monkeypatch.setattr(scalars, "check", late)
        code = main(argv)
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("psgd: error: ") and "ports" not in err and "psgd run: psgd, mode" not in err, err
    assert "resumes from them" not in err, err   # (that job's checkpoints: not this refused run's to resume)


@pytest.mark.parametrize("sets,warned", [
    (["mode.local_steps=1"], True),
    (["mode.local_steps=1", "cluster.workers=4", "optimizer.schedule=cosine"], True),
    ([], False),                                            # H = 20: 0.99
    (["mode.local_steps=2"], False),                         # 0.87-0.95
    (["mode.local_steps=1", "optimizer.momentum=0.5"], False),   # 0.99
    (["mode.local_steps=1", "mode.outer_momentum=0.5"], False),  # 0.99
    (["mode.local_steps=1", "mode.outer_lr=1", "mode.outer_momentum=0"], False),  # averaging: 0.99
    (["mode.local_steps=1", "mode.outer_lr=0.05"], False),   # 0.90
    (["mode.local_steps=1", "optimizer.lr=0.01"], False),    # 0.96
    (["mode.local_steps=1", "optimizer.nesterov=true"], False),  # 0.94
    (["mode.local_steps=1", "optimizer.name=adam", "optimizer.lr=0.001"], False),  # 0.95
])
def test_run_warns_at_start_of_diloco_rounds_of_one_step_with_both_momenta(sets, warned, no_job, capsys, tmp_path):
    """diloco with local_steps = 1 and the default momenta (inner 0.9, outer 0.9) trains
    to chance (0.07-0.23 at 1-4 workers, docs/modes.md) and used to say nothing; the
    settings measured to train get no warning."""
    lines, err = warning_lines(["--mode", "diloco"], sets, "local_steps", capsys, tmp_path)
    assert len(lines) == int(warned), err
    if warned:
        assert lines[0].startswith("psgd run: warning: mode diloco with mode.local_steps = 1") and "chance" in lines[0]


def warning_lines(args: list[str], sets: list[str], marker: str, capsys, tmp_path) -> tuple[list[str], str]:
    """`psgd run` with these args and --set keys (no job is run: `no_job`): its stderr's
    lines that name `marker`, and the whole of it."""
    argv = ["run", *args, "--out", str(tmp_path / "out")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if marker in line], err


@pytest.mark.parametrize("sets,warned", [
    ([], True),                                                  # 0.35, 0.08
    (["cluster.workers=3"], True),                               # 0.37, 0.28
    (["optimizer.nesterov=true"], True),                         # 0.39, 0.73
    (["mode.lr_policy=staleness"], True),                        # 0.43, 0.19
    (["cluster.workers=1"], False),                              # 0.88, 0.88
    (["optimizer.momentum=0.8"], False),                         # 0.96, 0.97
    (["optimizer.lr=0.05"], False),                              # 0.98, 0.98
    (["optimizer.name=adam", "optimizer.lr=0.001"], False),      # 0.97, 0.97
    (["mode.prefetch=false"], False),                            # 0.99 (docs/modes.md)
])
def test_run_warns_at_start_of_async_prefetch_at_two_workers_with_momentum(sets, warned, no_job, capsys, tmp_path):
    """async with prefetch at 2 or more workers and the default SGD (momentum 0.9, lr 0.1)
    trained the default job to 0.07-0.73 (docs/modes.md) and said nothing; the settings
    measured to train get no warning."""
    lines, err = warning_lines(["--mode", "async", "--set", "mode.prefetch=true"], sets, "mode.prefetch", capsys,
                               tmp_path)
    assert len(lines) == int(warned), err
    if warned:
        assert lines[0].startswith("psgd run: warning: mode async with mode.prefetch at 2 or more workers")
        assert "optimizer.momentum=0.5" in lines[0]


@pytest.mark.parametrize("mode", ["sync", "ssp", "async", "easgd", "ltfb"])
def test_no_mode_warning_for_the_other_modes_with_one_step_settings(mode, no_job, capsys, tmp_path):
    """(Their warning is that they read no mode.local_steps: the next test.)"""
    assert main(["run", "--mode", mode, "--set", "mode.local_steps=1", "--out", str(tmp_path / "out")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "local_steps" in line]
    assert lines == [f"psgd run: warning: this job reads none of mode.local_steps (mode {mode}'s parameters: "
                     f"{', '.join(PARAMS[mode])}): setting it changes nothing"], lines


@pytest.mark.parametrize("sets, said", [
    (["mode.prefetch=true"], "this job reads none of mode.prefetch (mode sync's parameters: backup_workers): "
                             "setting it changes nothing"),
    (["mode.prefetch=true", "sim.latency_s=1e-3", "mode.backup_workers=1", "cluster.workers=3"],
     "this job reads none of mode.prefetch (mode sync's parameters: backup_workers); sim.latency_s (psgd simulate's "
     "cost model): setting them changes nothing"),
    (["mode.backup_workers=1", "cluster.workers=3"], None),
    (["model.name=cnn", "model.hidden=4", "data.samples=100"],   # (a helper's: the CNN trained, unsaid)
     "this job reads none of data.samples (the synthetic dataset's; data.name = digits); model.hidden (the mlp's "
     "width; model.name = cnn): setting them changes nothing"),
    (["model.hidden=4", "data.name=synthetic", "data.samples=100"], None),
])
def test_run_warns_of_the_keys_given_that_its_job_never_reads(sets, said, no_job, capsys, tmp_path):
    """A review: `psgd run --mode sync --set mode.prefetch=true` (another mode's
    parameter) or `--set sim.latency_s=...` ran as if not given, without a word."""
    argv = ["run", "--mode", "sync", "--out", str(tmp_path / "out")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "reads none of" in line]
    assert lines == ([f"psgd run: warning: {said}"] if said else []), lines


def test_run_warns_of_a_variable_its_job_never_reads_and_not_of_a_config_files_keys(no_job, capsys, tmp_path,
                                                                                     monkeypatch):
    """A variable is as explicit as --set; a config file may hold every mode's keys."""
    (tmp_path / "job.toml").write_text("[mode]\nstaleness = 3\nprefetch = true\n")
    monkeypatch.setenv("PSGD_MODE_CACHE", "true")
    assert main(["run", str(tmp_path / "job.toml"), "--mode", "sync", "--out", str(tmp_path / "out")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "reads none of" in line]
    assert lines == ["psgd run: warning: this job reads none of mode.cache (mode sync's parameters: "
                     "backup_workers): setting it changes nothing"], lines


def test_run_warns_once_when_a_batch_is_larger_than_a_workers_share_of_the_data(no_job, capsys, tmp_path):
    """A batch larger than a worker's share of the training set shrinks to the share, and
    psgd run said nothing (only each worker's log gave its batch)."""
    argv = ["run", "--workers", "2", "--set", "data.name=synthetic", "--set", "data.samples=40",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "train.batch_size" in line]
    assert len(lines) == 1 and lines[0].startswith("psgd run: warning: train.batch_size = 32 is larger than"), lines
    assert "2 workers" in lines[0] and main(["run", "--out", str(tmp_path / "o2")]) == 0
    assert "train.batch_size" not in capsys.readouterr().err   # the default job: no warning


def test_psgd_version_says_the_packages_version(capsys):
    """`psgd --version` said "the following arguments are required: cmd"."""
    from psgd import __version__
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"psgd {__version__}"


def test_a_run_interrupted_in_a_pipe_whose_reader_ended_exits_with_its_signals_code(tmp_path, no_job, monkeypatch):
    """Ctrl-C on `psgd run ... 2>&1 | tee log` ends tee too: the line saying the run was
    interrupted raised BrokenPipeError, and the exit was 141, not 130."""
    import io
    import sys

    import psgd.launcher

    def run_local(cfg, out, **kw):
        kw["announce"]()
        os.close(read)   # the signal ended the reader too
        raise KeyboardInterrupt
    monkeypatch.setattr(psgd.launcher, "run_local", run_local)
    read, write = os.pipe()
    os.set_blocking(write, False)
    stderr = io.TextIOWrapper(io.FileIO(write, "w"), write_through=True)
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        assert main(["run", "--out", str(tmp_path / "out")]) == 130
    finally:
        stderr.close()


def test_the_launchers_lines_to_a_pipe_whose_reader_ended_do_not_cut_its_stop_short(monkeypatch):
    """A review: `psgd run --script ... 2>&1 | tee log`, then a Ctrl-C that ended tee first:
    the launcher's line that it waits for the scripts (`log`) raised BrokenPipeError out of
    its stop: the scripts' saves never ran, pid files stayed, and the exit was 141."""
    import io
    import sys

    from psgd.launcher import Child, LocalJob
    read, write = os.pipe()
    os.close(read)
    stderr = io.TextIOWrapper(io.FileIO(write, "w"), write_through=True)
    monkeypatch.setattr(sys, "stderr", stderr)

    class Running:
        pid = 0

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    job = LocalJob.__new__(LocalJob)
    job.children = [Child("worker", 0, [], proc=Running(), script=True)]
    try:
        assert job.let_scripts_leave() is None   # said, to a reader that is gone: no BrokenPipeError
    finally:
        stderr.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets,warned", [
    (["faults.slow_rank=7", "faults.slow_factor=4"], "faults.slow_rank = 7 is no rank of this job's 2 workers"),
    (["faults.slow_factor=4"], "faults.slow_factor = 4 slows no worker: faults.slow_rank = -1"),
    (["faults.slow_rank=1"], "faults.slow_rank = 1 slows nothing: faults.slow_factor = 1"),
    (["faults.slow_rank=1", "faults.slow_factor=4"], None),
    (["faults.jitter_prob=0.5"], "faults.jitter_prob = 0.5 delays nothing: faults.jitter_s = 0"),
    (["faults.jitter_s=0.5"], "faults.jitter_s = 0.5 delays nothing: faults.jitter_prob = 0"),
    (["faults.jitter_s=0.5", "faults.jitter_prob=0.1"], None),
    (["faults.slow_factor=4", "faults.jitter_s=0.5"],   # both: the second was not said
     ("faults.slow_factor = 4 slows no worker", "faults.jitter_s = 0.5 delays nothing")),
])
def test_run_warns_of_an_injected_straggler_that_slows_no_worker(sets, warned, no_job, capsys, tmp_path):
    """`psgd run --workers 2 --set faults.slow_rank=7 ...` (or a slow_factor without a
    slow_rank, one half of the jitter pair) ran a job with no straggler and said nothing."""
    argv = ["run", "--workers", "2", "--out", str(tmp_path / "out")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "faults." in line]
    warned = () if warned is None else (warned,) if isinstance(warned, str) else warned
    assert len(lines) == len(warned), lines
    for line, said in zip(lines, warned, strict=True):
        assert line.startswith(f"psgd run: warning: {said}"), lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,says", [
    ("file", "is a file, not a folder (psgd keys DIR makes or completes the folder DIR)"),   # "File exists: x", exit 1
    ("empty", "psgd keys: give a folder to write the keys into"),   # "[Errno 2] No such file or directory: ''"
])
def test_keys_into_a_file_or_no_folder_is_one_usage_error(tmp_path, capsys, what, says):
    target = tmp_path / "c.toml"
    target.write_text("[train]\n")
    assert main(["keys", str(target) if what == "file" else ""]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert target.read_text() == "[train]\n"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_daemon_started_by_hand_computes_on_one_thread_unless_told(monkeypatch):
    """Helper G: a job of daemons started by hand ran 14x slower than under psgd run (1,692
    against 23,335 samples/s on 2 cores): psgd run sets OMP_NUM_THREADS=1, a hand-started
    daemon took torch's thread per core."""
    import torch

    from psgd import cli
    seen = []
    monkeypatch.setattr(cli, "cmd_daemon", lambda args: seen.append(
        (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())) or 0)
    monkeypatch.setattr("psgd.forkserver.end_with_launcher", lambda: None)
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert cli._main(["worker", "--rank", "0"], own_process=True) == 0
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert cli._main(["worker", "--rank", "0"], own_process=True) == 0
        monkeypatch.delenv("OMP_NUM_THREADS")   # a call from Python: the caller's process is not the daemon's
        assert cli.main(["worker", "--rank", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert seen == [("1", 1), ("3", 3), (None, 3)]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_daemon_started_by_hand_raises_its_open_file_limit(monkeypatch):
    """A review: the soft limit on open files was raised by `psgd run` and by a daemon that
    listens (coordinator, shard), not by a worker or an evaluator started by hand, under
    Compose or Slurm (about 4 descriptors a shard it reaches), though the docs said daemons."""
    resource = pytest.importorskip("resource")
    from psgd import cli
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard limit on open files {hard}: nothing to raise")
    seen = []
    monkeypatch.setattr(cli, "cmd_daemon", lambda args: seen.append(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0]) or 0)
    monkeypatch.setattr("psgd.forkserver.end_with_launcher", lambda: None)
    monkeypatch.setenv("OMP_NUM_THREADS", str(os.environ.get("OMP_NUM_THREADS") or 1))
    try:
        for role, own in (("worker", True), ("evaluator", True), ("worker", False)):
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
            argv = [role, "--rank", "0"] if role == "worker" else [role]
            assert (cli._main(argv, own_process=True) if own else cli.main(argv)) == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert seen[0] > 256 and seen[1] > 256 and seen[2] == 256, seen   # (a call from Python: the caller's limit)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,says", [
    (["run", "--workers", "two"], "psgd run: error: argument --workers: invalid int value: 'two'"),
    (["run", "--workers"], "psgd run: error: argument --workers: expected one argument"),
    (["server"], "psgd server: error: the following arguments are required: --shard"),
    (["compare", "--repeats", "x"], "psgd compare: error: argument --repeats: invalid int value: 'x'"),
    (["simulate", "--jobs", "x"], "psgd simulate: error: argument --jobs: invalid int value: 'x'"),
])
def test_a_bad_option_value_is_one_line(argv, says, capsys):
    """`psgd run --workers two` printed the verb's whole usage, five lines, before the one
    that said what was wrong."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(says) and f"(psgd {argv[0]} --help lists the options)" in err, err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_output_folder_check_of_two_commands_at_once_into_one_new_parent_fails_neither(tmp_path):
    """A review: the check made the missing folders and removed them again, so two commands
    started at once into sibling folders of a new parent (`--out sweep/a`, `--out sweep/b`)
    could remove the parent as the other made its folder: 'cannot make this folder: No such
    file or directory', exit 2 (8 in 3,000 checks), and parents were left behind."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        said = pool.starmap(_check_often, [(str(tmp_path / "sweep" / "a"), 1500),
                                           (str(tmp_path / "sweep" / "b"), 1500)])
    assert said == [[], []], said
    assert os.listdir(tmp_path) == []


def _check_often(out: str, n: int) -> list[str]:
    from psgd.cli import _cannot_make
    return [why for _ in range(n) if (why := _cannot_make(out))][:3]


@pytest.mark.timeout(10)
def test_untrained_warning_only_for_a_job_of_no_samples():
    from psgd.cli import untrained_warning
    assert untrained_warning({"samples": 640}, script=True) == ""
    assert untrained_warning({}, script=True) == ""   # (a summary without the count says nothing)
    assert untrained_warning({"samples": 0}, script=False) == "no worker took a training step (0 samples): " \
                                                             "the model is untrained"
    assert untrained_warning({"samples": 0}, script=True).endswith("does the script call ps.step() for each batch?")


@pytest.mark.timeout(10)
def test_cpu_wait_warning_from_a_tenth_of_the_workers_runnable_time():
    from psgd.cli import cpu_wait_warning
    for quiet in ({"wall_s": 5.0}, {"cpu_wait_fraction": None, "wall_s": 5.0},
                  {"cpu_wait_fraction": 0.0949, "wall_s": 5.0}, {"cpu_wait_fraction": 0.4512, "wall_s": 0.9}):
        assert cpu_wait_warning(quiet, crowded=False) == ""   # (below 1 s, a few preemptions' share)
    assert cpu_wait_warning({"cpu_wait_fraction": 0.0996, "wall_s": 1.0}, crowded=False)   # (as written: 10%)
    assert cpu_wait_warning({"cpu_wait_fraction": 0.4512, "wall_s": 1.0}, crowded=False).startswith(
        "its workers waited for a CPU 45% of the time they could run (summary.json's cpu_wait_fraction): "
        "processes other than its shards, workers and evaluator held the cores")
    # a job whose own busy processes outnumber the cores was warned of that at its start
    assert cpu_wait_warning({"cpu_wait_fraction": 0.4512, "wall_s": 5.0}, crowded=True) == ""


@pytest.mark.timeout(10)
def test_summary_cpu_wait_fraction_is_of_the_workers_runnable_time():
    from psgd.metrics import summarize
    common = dict(mode="sync", mode_params={}, workers=2, servers=1, wall_s=1.0, server_stats={}, evals=[],
                  target=0.9, failures={})
    both = {0: {"cpu_run_s": 3.0, "cpu_wait_s": 1.0}, 1: {"cpu_run_s": 4.0, "cpu_wait_s": 2.0}}
    assert summarize(worker_stats=both, **common)["cpu_wait_fraction"] == 0.3   # (3 of 10 s runnable)
    one = {0: {"cpu_run_s": 3.0, "cpu_wait_s": 1.0}, 1: {"samples": 10}}   # (a worker that counted none)
    assert summarize(worker_stats=one, **common)["cpu_wait_fraction"] == 0.25
    assert summarize(worker_stats={0: {"samples": 10}}, **common)["cpu_wait_fraction"] is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,other", [("server", "client"), ("client", "server")])
def test_keys_refuses_a_kept_public_key_that_is_no_key(tmp_path, capsys, name, other):
    """A hunt: a client's folder whose server.key was damaged said "server.key kept", and
    every job with the folder failed at its first connection."""
    (tmp_path / f"{name}.key").write_text("garbage\n")
    assert main(["keys", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/{name}.key is not a CurveZMQ public key" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / f"{other}.key").exists()   # nothing made beside a folder refused


@pytest.mark.timeout(10)
def test_ltfb_of_one_trainer_is_warned_of_holding_no_tournament():
    """A hunt: `--mode ltfb --workers 1` (one trainer) ran with no tournament, and no word."""
    from psgd.cli import lone_trainer
    from psgd.config import Config
    one = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 1})
    assert lone_trainer(one).startswith("mode ltfb with one trainer (1 worker, mode.trainer_size = 1) holds no "
                                        "tournament")
    assert "(2 workers, mode.trainer_size = 2)" in lone_trainer(one.replace(**{"cluster.workers": 2,
                                                                                "mode.trainer_size": 2}))
    assert lone_trainer(one.replace(**{"cluster.workers": 2})) == ""
    assert lone_trainer(one.replace(**{"mode.name": "async"})) == ""


@pytest.mark.parametrize("raised", ["zmq", "os"])
def test_a_process_out_of_file_descriptors_says_its_limit_in_one_line(raised, capsys):
    """Under `ulimit -n 16` the evaluator died with ZeroMQ's traceback (zmq.ZMQError is
    no OSError) and was restarted five times; a worker said "[Errno 24] Too many open
    files", without the limit to raise."""
    import argparse
    import errno

    import zmq

    from psgd.cli import _command

    def handler(args):
        raise zmq.ZMQError(errno.EMFILE) if raised == "zmq" else OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    assert _command(handler, argparse.Namespace(cmd="evaluator"), {}) == 1
    err = capsys.readouterr().err
    assert err.startswith("psgd evaluator: error: Too many open files (ulimit -n ")
    assert err.endswith(": raise it; or ZeroMQ's limit of sockets a process, 1,023 by default: about 3 a peer)\n"
                        if raised == "zmq" else ": raise it)\n")
    assert "Traceback" not in err and len(err.splitlines()) == 1
