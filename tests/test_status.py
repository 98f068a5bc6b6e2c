"""`psgd status` (psgd/status.py): the coordinator's status op and the table it prints."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import zmq

from psgd import wire
from psgd.cli import main
from psgd.config import Config, load
from psgd.inprocess import InProcessCluster
from psgd.keys import make_keys
from psgd.membership import CoordinatorLink
from psgd.status import ask, table
from psgd.transport import Service, server_socket
from tests.conftest import free_port_block

pytestmark = pytest.mark.inprocess


@pytest.mark.timeout(60)
def test_status_shows_each_worker_and_shard_of_a_running_job():
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.servers": 2,
                              "cluster.timeout_s": 10.0, "cluster.heartbeat_s": 0.1, "cluster.evaluator": False})
    with InProcessCluster(cfg) as cluster:
        links = [CoordinatorLink(cfg, "worker", r, cluster.ctx) for r in range(2)]
        for r, link in enumerate(links):
            link.stats_fn = lambda r=r: {"samples": 320 * (r + 1), "elapsed_s": 2.0, "wait_s": 0.5,
                                         "staleness_hist": [1, 1], "rejected": r}
            link.clock_fn = lambda r=r: 10 * (r + 1)
        try:
            joins = [threading.Thread(target=link.register, args=(r,)) for r, link in enumerate(links)]
            for t in joins:
                t.start()
            for t in joins:
                t.join(timeout=20)
            for link in links:
                link.start()
            deadline = time.monotonic() + 20
            while True:  # until both workers' heartbeats and both shards' have arrived
                reply = ask(cfg, cfg.coordinator_address())
                if (all(w.get("samples") for w in reply.get("workers"))
                        and [s.get("version") for s in reply.get("shards")] == [0, 0]) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for link in links:
                link.close()
    text = table(reply)
    lines = text.splitlines()
    assert lines[0].startswith("phase training  mode sync backup_workers=0"), text
    assert "live 2/2" in lines[0] and "last evaluation: none yet" in text
    rows = {line.split()[0]: line.split() for line in lines if line[:1].isdigit()}
    assert rows["0"][:7] == ["0", "live", "10/300", "160", "0.50", "25%", "0"], text
    assert rows["1"][:7] == ["1", "live", "20/300", "320", "0.50", "25%", "1"], text
    assert "shard 0: version 0" in text and "shard 1: version 0" in text


@pytest.mark.timeout(30)
def test_status_of_a_finished_job_prints_its_summary(tmp_path, capsys):
    cfg = Config().replace(**{"cluster.port": free_port_block(3)})  # nobody listens there
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    summary = {"mode": "sync", "final_accuracy": 0.97, "final_loss": 0.1, "samples_per_s": 5000.0, "wall_s": 4.0,
               "time_to_target_s": 1.0, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["status", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("finished: sync: accuracy 0.9700")
    # (an aborted job's summary read "finished: sync: accuracy ...", exit 0; psgd run said "job aborted", exit 1)
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "aborted": "worker 1 was lost"}))
    assert main(["status", str(tmp_path)]) == 1
    assert capsys.readouterr().out.startswith("aborted: worker 1 was lost: sync: accuracy 0.9700")
    (tmp_path / "summary.json").unlink()
    assert main(["status", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    # (said "a job secured with CurveZMQ answers only a client with its keys: --keys DIR or --config FILE":
    # DIR's config.toml has the job's security settings, and this job has no CurveZMQ)
    assert "no answer from the coordinator" in err and "--keys" not in err, err
    assert f"{tmp_path}'s job has not started yet, or ended without a summary: interrupted or killed)" in err, err
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "shard-0.pt").write_bytes(b"")
    assert main(["status", str(tmp_path)]) == 1
    assert f"killed; its checkpoints are in {tmp_path / 'checkpoints'})" in capsys.readouterr().err
    from psgd.status import _silent
    assert _silent(Config(), str(tmp_path), "training") == (f"{tmp_path}'s job ended without a summary (it was "
                                                             f"training): interrupted or killed; its checkpoints "
                                                             f"are in {tmp_path / 'checkpoints'}")
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert f"no folder {tmp_path / 'nope'}" in capsys.readouterr().err     # said it had no config.toml
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 2
    assert "has no config.toml" in capsys.readouterr().err
    for text, why in (("{bad json", "Expecting property name"), ("[1, 2]", "a JSON list, not an object")):
        (tmp_path / "summary.json").write_text(text)   # were a JSONDecodeError / AttributeError traceback
        assert main(["status", str(tmp_path)]) == 1
        assert f"summary.json is not a psgd summary ({why}" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_status_of_a_finished_job_whose_psgd_run_still_waits_for_its_scripts_says_so(tmp_path, capsys):
    """A script job's summary is written when training ends; psgd run then waits (up to
    --timeout) for the scripts' own work after close(), and a script that fails then fails
    the run. `psgd status DIR` meanwhile said only "finished: ...", exit 0."""
    from psgd.launcher import LOCK_FILE, hold
    cfg = Config().replace(**{"cluster.port": free_port_block(3)})  # nobody listens there
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    assert main(["status", str(tmp_path)]) == 0
    assert "has not returned" not in capsys.readouterr().out   # (no lock file: none is made)
    assert not (tmp_path / LOCK_FILE).exists()
    lock = hold(str(tmp_path / LOCK_FILE))   # as psgd run holds it until it returns
    try:
        assert main(["status", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("finished: sync: accuracy 0.9700") and "its psgd run has not returned yet" in out, out
        assert len(out.splitlines()) == 1, out
    finally:
        lock.close()
    assert main(["status", str(tmp_path)]) == 0   # returned: the lock file stays, unheld
    assert "has not returned" not in capsys.readouterr().out
    again = hold(str(tmp_path / LOCK_FILE))   # and status took no lock that outlives it
    assert again is not None
    again.close()


@pytest.mark.timeout(30)
def test_status_of_a_killed_job_says_it_ran_or_that_its_processes_still_run(tmp_path):
    """`kill -9` of `psgd run` after 20 s of training: its daemons exit and remove their
    pid files, and `psgd status DIR` said "has not started yet, or ended without a
    summary", though DIR/events held the job's 20 s. A job whose daemons still run while
    its coordinator does not answer (stopped, or gone alone) was said to be killed."""
    from psgd.status import _silent
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "coordinator-0.jsonl").write_text('{"t": 0.0, "event": "start"}\n')
    os.utime(tmp_path / "events" / "coordinator-0.jsonl", (0, time.mktime((2026, 12, 3, 23, 36, 5, 0, 0, -1))))
    assert _silent(Config(), str(tmp_path)) == (f"{tmp_path}'s job ended without a summary (it ran: its last event "
                                                f"was written at 2026-12-03 23:36:05): interrupted or killed")
    pids = tmp_path / "pids"
    pids.mkdir()
    (pids / "server-0.pid").write_text(f"{os.getpid()}\n")   # this process: it runs
    (pids / "worker-0.pid").write_text("999999999\n")         # no such process: a leftover
    assert _silent(Config(), str(tmp_path)) == (f"{tmp_path}'s pid files name processes that run on this machine "
                                                f"(server-0) and its coordinator does not answer (no coordinator "
                                                f"among them)")
    (pids / "coordinator-0.pid").write_text(f"{os.getpid()}\n")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "shard-0.pt").write_bytes(b"")
    assert _silent(Config(), str(tmp_path)).endswith(f"this machine (coordinator-0, server-0) and its coordinator "
                                                     f"does not answer; its checkpoints are in "
                                                     f"{tmp_path / 'checkpoints'}")


@pytest.mark.timeout(30)
def test_status_of_a_folder_whose_event_logs_go_while_it_looks(tmp_path, monkeypatch):
    """A job starting in DIR removes the earlier job's event logs: one listed and gone
    before it was read was a FileNotFoundError traceback from `psgd status DIR`."""
    from psgd import status
    (tmp_path / "events").mkdir()
    kept = tmp_path / "events" / "worker-0.jsonl"
    kept.write_text('{"t": 0.0}\n')
    os.utime(kept, (0, time.mktime((2026, 12, 4, 3, 0, 0, 0, 0, -1))))
    listed = [str(tmp_path / "events" / "coordinator-0.jsonl"), str(kept)]   # the first gone since
    monkeypatch.setattr(status.glob, "glob", lambda pattern: listed if pattern.endswith(".jsonl") else [])
    assert status._silent(Config(), str(tmp_path)) == (f"{tmp_path}'s job ended without a summary (it ran: its "
                                                       f"last event was written at 2026-12-04 03:00:00): "
                                                       f"interrupted or killed")
    listed.remove(str(kept))
    assert "has not started yet, or ended without a summary" in status._silent(Config(), str(tmp_path))


@pytest.mark.timeout(30)
def test_status_errors_are_one_line_with_one_prefix(tmp_path, capsys):
    """`psgd status FILE` said "no folder FILE", and every refusal began "psgd: error:
    psgd status: ..."."""
    (tmp_path / "a-file").write_text("")
    assert main(["status", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"psgd: error: {tmp_path / 'a-file'} is a file, not a folder"), err
    assert len(err.strip().splitlines()) == 1
    for args in (["status"], ["status", str(tmp_path)], ["status", "--address", "foo"],
                 ["status", str(tmp_path), "--config", "x.toml"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("psgd: error: ") and "psgd status:" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(30)
def test_status_of_a_compare_folder_names_its_runs(tmp_path, capsys):
    """`psgd status OUT` of a `psgd compare` said "OUT has no config.toml (is it a psgd
    run's output folder?)": it names the run folders to give instead."""
    for name in ("sync-w2-r0", "async-w2-r0"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.toml").write_text("")
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path} is a psgd compare's output folder: give one of its runs, "
            f"{tmp_path / 'runs' / 'async-w2-r0'} or {tmp_path / 'runs' / 'sync-w2-r0'}") in err, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, said", [
    (["--address", "foo"], "--address must be tcp://HOST:PORT"),     # was a ZMQError traceback
    (["--address", "tcp://127.0.0.1:1", "--watch", "-1"], "expected a number of seconds > 0"),
    (["--address", "tcp://127.0.0.1:1", "--watch", "nan"], "expected a number of seconds > 0"),
    (["--address", "tcp://127.0.0.1:99999"], "a port in 1..65535"),        # waited 3 s, then blamed CurveZMQ
    (["--address", "tcp://10.0.0.1"], "(no port 1..65535 after the host)"),
    (["--address", "tcp://10.0.0.1:7100:7400"], "(a host takes no scheme, port or path)"),   # was asked, for 3 s
    (["--address", "tcp://127.0.0.1:5555", "--keys", "/psgd-no-keys"], "/psgd-no-keys/client.key_secret not found"),
])
def test_status_refuses_a_bad_address_or_watch_period_in_one_line(capsys, args, said):
    try:
        code = main(["status", *args])
    except SystemExit as e:   # argparse's own error
        code = e.code
    assert code == 2 and said in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_status_out_of_file_descriptors_says_so_not_that_the_address_is_bad(monkeypatch, capsys):
    """A process out of descriptors as it made its socket was told "cannot connect to
    'tcp://...': Too many open files", exit 2, as a bad address, without the limit to raise."""
    import errno

    import psgd.status

    def no_descriptor(*args, **kwargs):
        raise zmq.ZMQError(errno.EMFILE)
    monkeypatch.setattr(psgd.status, "Peers", no_descriptor)
    assert main(["status", "--address", "tcp://127.0.0.1:5555"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("psgd status: error: Too many open files (ulimit -n ") and "cannot connect" not in err, err


@pytest.mark.timeout(60)
def test_status_at_an_address_reaches_a_job_secured_with_curve_given_its_keys(tmp_path, capsys):
    """`psgd status --address` used the default config (no CurveZMQ): a secured job never
    answered, and the message said "not started yet, or gone"."""
    from psgd.keys import make_keys
    keys = str(tmp_path / "keys")
    make_keys(keys)
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "cluster.servers": 1, "cluster.evaluator": False,
                              "security.curve": True, "security.keys": keys})
    config = tmp_path / "job.toml"
    config.write_text(cfg.to_toml())
    address = cfg.coordinator_address()
    with InProcessCluster(cfg):
        assert main(["status", "--address", address]) == 1
        err = capsys.readouterr().err
        assert "a job secured with CurveZMQ answers only a client with its keys: --keys DIR" in err, err
        for how in (["--keys", keys], ["--config", str(config)],
                    ["--set", "security.curve=true", "--set", f"security.keys={keys}"]):
            assert main(["status", "--address", address, *how]) == 0, capsys.readouterr().err
            assert capsys.readouterr().out.startswith("phase "), how
        other = str(tmp_path / "other")
        make_keys(other)  # keys of another job: the server does not know this client
        assert main(["status", "--address", address, "--keys", other]) == 1
        assert f"it was asked with the keys in {other}" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_status_of_a_curve_jobs_folder_from_another_folder(tmp_path, capsys, monkeypatch):
    """A helper's use: a job started with `--set security.keys=keys` (relative) wrote
    keys = "keys" into OUT/config.toml, so `psgd status OUT` from any other folder said
    "security.keys: keys/client.key_secret not found" (README: DIR/config.toml already
    has the keys). The job's config.toml names the folder absolutely, psgd run's and a
    coordinator's started by hand alike."""
    from psgd.launcher import LocalJob
    monkeypatch.chdir(tmp_path)
    make_keys("keys")
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "cluster.servers": 1, "cluster.evaluator": False,
                              "security.curve": True, "security.keys": "keys"})
    LocalJob(cfg, "run", quiet=True).stop()   # (writes run/config.toml, starts nothing)
    assert load("run/config.toml", env={}).security.keys == str(tmp_path / "keys")
    (tmp_path / "elsewhere").mkdir()
    out = str(tmp_path / "by-hand")
    with InProcessCluster(cfg, out):
        # From another folder in another process: the daemons, threads of this one, load
        # the keys from this folder whenever they open a socket (a chdir here raced them).
        import subprocess
        import sys
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")},
               "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        r = subprocess.run([sys.executable, "-m", "psgd", "status", out], cwd=tmp_path / "elsewhere", env=env,
                           capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.startswith("phase "), r.stdout + r.stderr


@pytest.mark.timeout(30)
def test_each_shards_busy_share_is_its_serving_time_over_the_elapsed_time():
    from psgd import wire
    reply = wire.Message("reply", fields={"phase": "training", "elapsed_s": 4.0, "workers": [],
                                          "shards": [{"index": 0, "version": 9, "busy_s": 3.0},
                                                     {"index": 1, "version": 9, "busy_s": 0.0, "restarts": 1}]})
    assert table(reply).splitlines()[-1] == "shard 0: version 9, busy 75%  shard 1: version 9, 1 restart"


@pytest.mark.timeout(30)
def test_mode_parameters_and_counts_read_as_a_config_file_and_english_write_them():
    from psgd import wire
    reply = wire.Message("reply", fields={"phase": "training", "mode": "async", "elapsed_s": 4.0, "workers": [],
                                          "mode_params": {"prefetch": False, "n_push": 1},
                                          "shards": [{"index": 0, "version": 9, "restarts": 2, "bad_messages": 1}]})
    text = table(reply)
    assert text.startswith("phase training  mode async prefetch=false n_push=1  elapsed 4.0 s"), text
    assert text.splitlines()[-1] == "shard 0: version 9, 2 restarts, 1 bad message", text


SUMMARY = {"mode": "sync", "final_accuracy": 0.97, "final_loss": 0.1, "samples_per_s": 5000.0, "wall_s": 4.0,
           "time_to_target_s": 1.0, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0}}


@pytest.mark.timeout(60)
def test_status_of_a_finished_job_is_not_answered_by_a_later_job_on_its_port(tmp_path, capsys):
    """A review: Jobs reuse ports (5555 by default): `psgd status OLD_DIR` showed the new job's
    table as if it were the old job's, though OLD_DIR/summary.json says it finished."""
    port = free_port_block(3)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.toml").write_text(Config().replace(**{"cluster.port": port, "mode.name": "sync"}).to_toml())
    (old / "summary.json").write_text(json.dumps(SUMMARY))
    new = Config().replace(**{"cluster.port": port, "mode.name": "async", "cluster.servers": 1,
                              "cluster.evaluator": False})
    with InProcessCluster(new):
        code = main(["status", str(old)])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("finished: sync: accuracy 0.9700"), out


@pytest.mark.timeout(60)
def test_status_of_an_interrupted_job_is_not_answered_by_another_job_on_its_port(tmp_path, capsys):
    """A review: `psgd status DIR` of a job stopped with SIGTERM (checkpoints, no summary)
    while another job, in another folder, listens on DIR's port (5555 by default for every
    job): it printed that other job's table (mode async, phase rendezvous) as DIR's job.
    The status reply names its job's folder; the other job's own folder is answered."""
    port = free_port_block(3)
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "checkpoints").mkdir(parents=True)
    (old / "config.toml").write_text(Config().replace(**{"cluster.port": port, "mode.name": "sync"}).to_toml())
    (old / "checkpoints" / "shard-0.pt").write_text("an interrupted job's checkpoint")   # no summary.json
    cfg = Config().replace(**{"cluster.port": port, "mode.name": "async", "cluster.servers": 1,
                              "cluster.evaluator": False})
    with InProcessCluster(cfg, str(new)):
        code = main(["status", str(old)])
        out, err = capsys.readouterr()
        (new / "config.toml").write_text(cfg.to_toml())
        assert main(["status", str(new)]) == 0
        assert "mode async" in capsys.readouterr().out
    assert "mode async" not in out and code == 1, f"psgd status {old} described the job of {new}:\n{out}"
    assert f"{old}'s job is not running (interrupted: its checkpoints are in {old / 'checkpoints'}" in err, err
    assert len([line for line in err.splitlines() if line.startswith("psgd status")]) == 1, err


def watch_a_job_that_answers_once(fields: dict, then=lambda: None) -> int:
    """`psgd status --address A --watch 0.5` of a fake coordinator that answers one status
    request with `fields`, then (after `then()`: what the job does as it ends) exits as a
    coordinator does: main's exit code."""
    address = f"tcp://127.0.0.1:{free_port_block(1)}"
    ctx = zmq.Context()
    sock = server_socket(ctx, address, Config().security)
    answered = threading.Event()

    def on_status(ident, msg):
        answered.set()
        return [(ident, wire.reply(msg, done=False, mode="sync", mode_params={}, steps=10, workers_expected=1,
                                   shards=[], last_eval=None, **fields))]

    svc = Service(sock, {"status": on_status}, "fake-coordinator")

    def serve():
        while not answered.is_set():
            svc.poll(50)
        time.sleep(0.2)
        then()
        sock.close(0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        return main(["status", "--address", address, "--watch", "0.5"])
    finally:
        t.join(5)
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_watch_by_address_ends_cleanly_when_the_job_ends(capsys):
    """A review: `psgd status --address A --watch` on a job that finishes normally: the coordinator
    exits right after `done`, and the watch ended with exit 1 and "no answer ... (not
    started yet, or gone without a summary; a job secured with CurveZMQ ...)"."""
    code = watch_a_job_that_answers_once({"phase": "final_eval", "samples": 640, "elapsed_s": 2.0, "live": {},
                                          "workers": [{"rank": 0, "state": "finished", "clock": 10, "joins": 1}]})
    err = capsys.readouterr().err
    assert code == 0 and "CurveZMQ" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("abort, code", [("", 0), ("worker 1 was lost and faults.on_worker_loss = abort", 1)])
def test_a_job_that_answers_done_ends_the_watch_with_its_outcome(capsys, abort, code):
    """An aborted job's coordinator answers done with its reason: the watch printed it and
    exited 0, where psgd run (and psgd status DIR, from the summary) exit 1."""
    port = free_port_block(1)
    address = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    sock = server_socket(ctx, address, Config().security)

    def on_status(ident, msg):
        return [(ident, wire.reply(msg, phase="done", done=True, abort=abort, mode="sync", mode_params={}, steps=10,
                                   samples=640, elapsed_s=2.0, workers_expected=1, live={}, workers=[], shards=[],
                                   last_eval=None))]

    svc = Service(sock, {"status": on_status}, "fake-coordinator")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            svc.poll(50)
        sock.close(0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert main(["status", "--address", address, "--watch", "0.5"]) == code
    finally:
        stop.set()
        t.join(5)
        ctx.destroy(linger=0)
    out = capsys.readouterr().out
    assert out.startswith("phase done") and (f"aborted: {abort}" in out) == bool(abort), out


@pytest.mark.timeout(30)
def test_a_malformed_key_file_is_one_line_from_psgd_status(tmp_path, capsys):
    """A review: client.key_secret holding the public key (a copy gone wrong) or nothing: a
    ValueError traceback out of `psgd status --keys DIR`."""
    keys = str(tmp_path / "keys")
    make_keys(keys)
    for bad in ("public", "empty"):
        path = os.path.join(keys, "client.key_secret")
        if bad == "public":
            shutil.copy(os.path.join(keys, "client.key"), path)
        else:
            open(path, "w").close()
        try:
            code = main(["status", "--address", f"tcp://127.0.0.1:{free_port_block(1)}", "--keys", keys])
        except ValueError as e:
            code = f"raised {e!r}"
        err = capsys.readouterr().err
        assert code == 2 and "client.key_secret" in err, (bad, code, err)


@pytest.mark.timeout(120)
def test_psgd_run_refuses_a_malformed_key_file_before_starting_anything(tmp_path, capsys):
    """A review: check_keys only asks whether the files exist: with a client.key_secret that holds no
    secret key, psgd run started the job, restarted a shard 5 times and ended with exit 1
    and a ValueError traceback (README: a bad config value is one line and exit 2, before
    anything starts)."""
    keys = str(tmp_path / "keys")
    make_keys(keys)
    shutil.copy(os.path.join(keys, "client.key"), os.path.join(keys, "client.key_secret"))
    t0 = time.monotonic()
    code = main(["run", "--set", "security.curve=true", "--set", f"security.keys={keys}", "--set", "train.steps=30",
                 "--set", f"cluster.port={free_port_block(3)}", "--quiet", "--out", str(tmp_path / "job")])
    err = capsys.readouterr().err
    assert code == 2 and "client.key_secret" in err and "Traceback" not in err, (code, err[-2000:])
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_status_of_a_folder_whose_daemons_were_started_by_hand(tmp_path, capsys):
    """A review: daemons started by hand (`psgd coordinator job.toml --out DIR`, as
    docs/deploy.md has them, and the Slurm scripts' and Compose's) left no DIR/config.toml,
    so `psgd status DIR` said "DIR has no config.toml (is it a psgd run's output
    folder?)", while the job ran and after it had written DIR/summary.json. The
    coordinator writes its resolved config there."""
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "mode.name": "async", "cluster.servers": 1,
                              "cluster.evaluator": False})
    out = tmp_path / "by-hand"
    with InProcessCluster(cfg, str(out)):
        code = main(["status", str(out)])
    captured = capsys.readouterr()
    assert code == 0 and "mode async" in captured.out, captured.err
    assert load(str(out / "config.toml"), env={}) == cfg


@pytest.mark.timeout(60)
def test_the_coordinator_leaves_a_users_own_config_toml_in_its_folder(tmp_path):
    """`psgd coordinator OUT/config.toml --out OUT`, the user's own file (comments, a few
    keys) in the folder: the coordinator's resolved config must not replace it. One that
    psgd wrote (an earlier job's, another port) is replaced."""
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "mode.name": "async", "cluster.servers": 1,
                              "cluster.evaluator": False})
    mine = "# my job\n[mode]\nname = \"async\"\n"
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.toml").write_text(mine)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.toml").write_text(cfg.replace(**{"cluster.port": 5555}).to_toml())
    for name in ("own", "old"):
        with InProcessCluster(cfg, str(tmp_path / name)):
            pass
    assert (tmp_path / "own" / "config.toml").read_text() == mine
    assert load(str(tmp_path / "old" / "config.toml"), env={}) == cfg


@pytest.mark.timeout(60)
def test_watch_by_address_of_a_job_that_ends_between_two_looks_prints_its_summary(tmp_path, capsys):
    """A review: `psgd status --address A --watch` of a `psgd run` job whose end (final
    score, summary, exit) fell between two looks: the watch had last seen it training,
    and ended with exit 1 and "no answer ... (not started yet, or gone without a summary;
    a job secured with CurveZMQ ...)". The coordinator's answers name its folder: the
    summary written there since is the job's end."""
    code = watch_a_job_that_answers_once(
        {"phase": "training", "samples": 64, "elapsed_s": 1.0, "live": {"0": 1}, "out": str(tmp_path),
         "workers": [{"rank": 0, "state": "live", "clock": 1, "joins": 1}]},
        then=lambda: (tmp_path / "summary.json").write_text(json.dumps(SUMMARY)))
    out, err = capsys.readouterr()
    assert code == 0 and "finished: sync: accuracy 0.9700" in out, err


@pytest.mark.timeout(30)
def test_status_of_a_simulate_folder_and_of_one_of_its_runs(tmp_path, capsys):
    """`psgd status` of a `psgd simulate` folder, or of one of its runs (a summary.json, no
    config.toml), said "... has no config.toml (is it a psgd run's output folder?)", exit 2:
    a run's prints its summary, marked simulated; the folder's names its runs."""
    summary = {"mode": "sync", "final_accuracy": 0.89, "final_loss": 0.3, "samples_per_s": 85552.0, "wall_s": 0.0,
               "time_to_target_s": None, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0},
               "simulated": True}
    for name in ("sync-w2-r0", "async-w2-r0"):
        (tmp_path / "runs" / name / "events").mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    assert main(["status", str(tmp_path / "runs" / "sync-w2-r0")]) == 0
    assert capsys.readouterr().out.startswith("finished (simulated by psgd simulate): sync: accuracy 0.8900")
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path} is a psgd simulate's output folder (its runs have ended: nothing runs there): give one "
            f"of its runs for its summary, {tmp_path / 'runs' / 'async-w2-r0'} or "
            f"{tmp_path / 'runs' / 'sync-w2-r0'}") in err, err
