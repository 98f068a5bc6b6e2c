"""What `pip install` makes of this checkout: one top-level package, `psgd`, with the
daemons of servers/ and workers/ as `psgd.servers` and `psgd.workers` (setup.cfg's
package_dir), every module of the tree in it, and the `psgd` command."""
from __future__ import annotations

import configparser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import psgd

ROOT = Path(__file__).resolve().parents[1]
# What the build reads: metadata, the license, the README (long_description), the code.
SOURCES = ["setup.cfg", "pyproject.toml", "README.md", "LICENSE", "psgd", "servers", "workers"]


def modules_in_tree() -> set[str]:
    """Every .py file of the package as the wheel must hold it: psgd/..., and servers/ and
    workers/ under psgd/."""
    found = {f"psgd/{p.relative_to(ROOT / 'psgd').as_posix()}" for p in (ROOT / "psgd").rglob("*.py")}
    for name in psgd.DAEMON_PACKAGES:
        found |= {f"psgd/{name}/{p.relative_to(ROOT / name).as_posix()}" for p in (ROOT / name).rglob("*.py")}
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (a stale build/ in the checkout would leak
    deleted modules into it), with this environment's setuptools: no download."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("psgd-*.whl")
    return whl


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_wheel_holds_psgd_only_with_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = f"psgd-{psgd.__version__}.dist-info"
    assert {n.split("/")[0] for n in names} == {"psgd", info}  # no top-level servers/ or workers/
    # A subpackage missing from setup.cfg's explicit `packages` list would be missing here.
    assert {n for n in names if n.endswith(".py")} == modules_in_tree()
    z = zipfile.ZipFile(wheel)
    metadata = z.read(f"{info}/METADATA").decode()
    assert f"Version: {psgd.__version__}" in metadata and "License: MIT" in metadata
    assert any(n.startswith(f"{info}/") and "LICENSE" in n for n in names)
    assert "psgd = psgd.cli:main" in z.read(f"{info}/entry_points.txt").decode()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_source_archive_holds_the_whole_test_suite(tmp_path):
    """The sdist held tests/test_*.py (setuptools' default) without conftest.py, __init__.py,
    loopback.py or streaming_data.py, so its tests could not run. MANIFEST.in grafts tests/."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES + ["MANIFEST.in", "tests", "docs", "examples"]:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy(path, src / name)
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "b.build_sdist(sys.argv[1])", str(tmp_path / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = (tmp_path / "dist").glob("psgd-*.tar.gz")
    import tarfile
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    tests = {f"tests/{p.name}" for p in (ROOT / "tests").glob("*.py")}
    assert tests - names == set(), sorted(tests - names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_installed_outside_the_checkout(wheel, tmp_path):
    """Installed into a fresh venv and run from a folder outside the checkout: the daemons
    import as psgd.*, never as top-level names. (The venv borrows the dependencies from this
    environment's site-packages through a .pth file, which does not run the .pth files
    there: an editable install of this checkout stays out of it.)"""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    deps = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    Path(purelib, "psgd-test-deps.pth").write_text("\n".join(deps) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSGD_", "PYTHON"))}
    # pip without PYTHONPATH too: on it, a checkout's psgd.egg-info (`pip install .` leaves one)
    # passed for psgd installed, and pip installed nothing.
    r = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", str(wheel)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    r = run(python, "-c", "import psgd, psgd.servers.shard_server, psgd.servers.coordinator, psgd.workers.worker, "
                          "psgd.workers.evaluator; print(psgd.__file__, psgd.servers.__file__, psgd.__version__)")
    assert r.returncode == 0, r.stderr
    where, servers, version = r.stdout.split()
    assert (where, servers) == (f"{purelib}/psgd/__init__.py", f"{purelib}/psgd/servers/__init__.py")
    assert version == psgd.__version__
    for name in psgd.DAEMON_PACKAGES:
        r = run(python, "-c", f"import {name}; print({name}.__file__)")
        assert r.returncode != 0 and f"No module named '{name}'" in r.stderr, (name, r.stdout)
    r = run(str(venv / "bin" / "psgd"), "--help")
    assert r.returncode == 0 and "usage: psgd" in r.stdout, r.stderr


@pytest.mark.unit
def test_in_the_checkout_only_the_daemon_folders_join_the_package():
    """servers/ and workers/ beside psgd/ become psgd.servers and psgd.workers; no other
    folder of the checkout becomes part of psgd (as all would with the root on __path__)."""
    if (ROOT / "psgd" / "servers").is_dir():
        pytest.skip("an installed layout: psgd/servers is a real subpackage")
    for name in psgd.DAEMON_PACKAGES:
        spec = importlib.util.find_spec(f"psgd.{name}")
        assert spec is not None and spec.origin == str(ROOT / name / "__init__.py")
    for name in ("tests", "bench", "deploy", "docs", "psgd"):
        assert importlib.util.find_spec(f"psgd.{name}") is None, name


@pytest.mark.unit
def test_the_package_summary_names_every_mode():
    """`pip show psgd`'s Summary (setup.cfg's description) named sync, ssp, async, easgd
    and ltfb side by side: diloco, the sixth mode, was missing from it."""
    from psgd.consistency import NAMES
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    named = re.findall(r"[a-z]+", cfg["metadata"]["description"].split(":", 1)[1])
    assert [n for n in named if n in NAMES] == list(NAMES)


@pytest.mark.unit
def test_ci_runs_the_readmes_test_command_with_what_it_needs():
    """The brief: .ci/run runs the README's test command on a clean checkout. Both say
    `pytest -n 2`, whose plug-in (pytest-xdist) the dev extras must install: a README
    command changed alone, or an extra dropped, failed only on a fresh machine."""
    readme = (ROOT / "README.md").read_text()
    setup = (ROOT / "setup.cfg").read_text()
    [test_command] = re.findall(r"^python3 -m venv \.venv && (.*-m pytest.*)$", readme, re.M)
    install, run = test_command.split(" && ")
    assert "'.[dev]'" in install and run.startswith(".venv/bin/python -m pytest")
    assert run in (ROOT / ".ci" / "run").read_text().splitlines(), run
    if " -n " in run:
        cfg = configparser.ConfigParser()
        cfg.read_string(setup)
        assert re.search(r"^pytest-xdist\b", cfg["options.extras_require"]["dev"], re.M), "pytest-xdist"
