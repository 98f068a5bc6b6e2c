"""A model's layout: what the shards need to know of a model, and nothing else.

A layout is a list of `[name, table, shape, dtype]` entries, in the model's order:
its trainable parameters (table "params"), then its floating-point buffers (table
"buffers"), as `psgd.sharding.model_layout` reads them; then what the shards do not
hold: frozen parameters (requires_grad=False) and non-float buffers, as
`[name, "fixed", shape, dtype, fingerprint]` (a hash of the values). The shards never
send those, so every worker must build them alike (seed the RNG, or load the same
weights): the coordinator refuses a worker whose fixed tensors differ from the job's,
naming the first that does (`difference`), instead of training replicas that compute
different functions. It travels as plain msgpack
(workers send it to the coordinator when they register; shards ask the coordinator for
it), so this module imports no torch: the coordinator uses it.

psgd's own models (`model.name` = mlp, cnn, resnet20) are built by the shards
themselves from the seed. Any other model (a `package.module:factory`, or a training
script's own model: `model.name = "script"`) is *learned*: the shards take its layout
from the workers and rank 0's initial values from its `init` request, so a shard server
never imports user code.
"""
from __future__ import annotations

import math
from typing import Any

BUILTIN_MODELS = ("mlp", "cnn", "resnet20")
SCRIPT_MODEL = "script"   # model.name of a job whose workers are the user's own training script
TABLES = ("params", "buffers")
FIXED = "fixed"           # a layout entry the shards do not hold (a frozen parameter, a non-float buffer)
MAX_ENTRIES = 100_000


def unfit_input(name: str, input_shape: tuple) -> str:
    """Why built-in model `name` cannot take inputs of `input_shape`, or '': the
    convolutional ones need images (C, H, W), ResNet-20's at least 8 high (without torch:
    `cli.check_model` asks before a job starts, `models.build_model` when it builds)."""
    if name in ("cnn", "resnet20") and (len(input_shape) != 3 or (name == "resnet20" and input_shape[1] < 8)):
        return f"model.name = {name} needs image inputs (C, H, W){' at least 8 high' * (name == 'resnet20')}, " \
               f"got {tuple(input_shape)}"
    return ""


def learned(model_name: str) -> bool:
    """Do the shards learn this model's layout from the workers (instead of building it)?"""
    return model_name not in BUILTIN_MODELS


def checked(layout: Any) -> list[list]:
    """A layout from the wire, validated: a list of [name, table, shape, dtype]; a
    ValueError naming the first bad entry."""
    if not isinstance(layout, list) or not 0 < len(layout) <= MAX_ENTRIES:
        raise ValueError(f"a layout is a non-empty list of at most {MAX_ENTRIES} entries")
    out = []
    for i, e in enumerate(layout):
        ok = (isinstance(e, (list, tuple)) and len(e) in (4, 5) and isinstance(e[0], str)
              and (e[1] in TABLES if len(e) == 4 else e[1] == FIXED and isinstance(e[4], str))
              and isinstance(e[2], (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in e[2])
              and isinstance(e[3], str))
        if not ok:
            raise ValueError(f"layout entry {i} is not [name, 'params'|'buffers', [dims], dtype] or "
                             f"[name, 'fixed', [dims], dtype, fingerprint]: {e!r:.200}")
        out.append([e[0], e[1], [int(d) for d in e[2]], *e[3:]])
    if not any(e[1] == "params" for e in out):
        raise ValueError("a layout needs at least one trainable parameter (table 'params')")
    return out


def entries(layout: list[list]) -> list[tuple[str, str, int]]:
    """(name, table, numel) per entry the shards hold: what `ShardMap` is built from."""
    return [(e[0], e[1], math.prod(e[2])) for e in layout if e[1] in TABLES]


def difference(job: list[list], other: list[list]) -> str:
    """'' if the layouts are the same, else the first difference, in words."""
    for i, (a, b) in enumerate(zip(job, other, strict=False)):
        if list(a) != list(b):
            if a[1] == b[1] == FIXED and list(a[:4]) == list(b[:4]):
                return (f"{a[0]} (not trained: a frozen parameter or a non-float buffer, which the shards do "
                        f"not send) has other values than the job's; build it alike on every worker: seed "
                        f"the RNG before building the model (torch.manual_seed) or load the same weights")
            return f"entry {i}: the job has {_describe(a)}, this model has {_describe(b)}"
    if len(job) != len(other):
        return f"the job's model has {len(job)} tensors, this one {len(other)}"
    return ""


def _describe(e: list) -> str:
    name, table, shape, dtype = e[:4]
    return f"{name} ({table}, shape {tuple(shape)}, {dtype})"


def size(layout: list[list]) -> int:
    return sum(n for _, _, n in entries(layout))
