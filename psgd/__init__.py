"""psgd: sharded parameter-server training for PyTorch, with pluggable consistency modes.

The daemons live in servers/ and workers/ at the top of the checkout and are installed
as `psgd.servers` and `psgd.workers` (setup.cfg's package_dir), so that psgd claims only
its own name in site-packages. In a checkout or an editable install those folders sit
beside this package instead of inside it; `_adopt_checkout_daemons` makes them its
subpackages, and only them (appending the checkout root to `__path__` would also make
`psgd.tests`, `psgd.deploy` and a second `psgd.psgd` importable).
"""
from __future__ import annotations

import importlib.util
import os
import sys

__version__ = "0.2.0"

DAEMON_PACKAGES = ("servers", "workers")


def _adopt_checkout_daemons() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    for name in DAEMON_PACKAGES:
        init = os.path.join(root, name, "__init__.py")
        if os.path.isdir(os.path.join(here, name)) or not os.path.isfile(init):
            continue  # installed: a real subpackage; or not a checkout
        spec = importlib.util.spec_from_file_location(f"{__name__}.{name}", init,
                                                      submodule_search_locations=[os.path.dirname(init)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        globals()[name] = module


_adopt_checkout_daemons()

_API = ("connect", "Connection", "JobError", "device")  # psgd.connect(model, optimizer): psgd/connection.py


def __getattr__(name: str):
    """The training-script API, imported on first use (so `import psgd` stays light)."""
    if name in _API:
        from . import connection
        return getattr(connection, name)
    if name == "ConfigError":   # what connect(), step(samples=...) raise for a bad rank, count or model
        from .config import ConfigError
        return ConfigError
    raise AttributeError(f"module 'psgd' has no attribute {name!r}")
