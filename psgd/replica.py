"""A worker's (or the evaluator's) copy of the model, seen through the shard map.

`Replica` moves between the model's tensors and the per-shard flat tables: `load`
writes what the shards sent into the model, `params`/`grads`/`buffers` gather what goes
back, into buffers allocated once and reused every step (a gathered table is valid
until the next gather of the same kind: the client sends it and waits for the answer
before the next step). On CUDA, tables are gathered on the device and copied to pinned
host buffers asynchronously. `score` evaluates on a labelled set without gradients.

Both directions go by runs (the shard map's pieces, adjacent pieces of one tensor
merged): a gather is one `torch.cat` of slices, a load one `torch._foreach_copy_`
from the table's split into views of the model's tensors made once (the MLP's step:
25-35 us each alone, against 75-105 us piece by piece through the shard map). So the
model's tensors must keep their storage: updated in place, never given new `.data`
(but once, by the replica itself: `flat`, where a worker's trainable parameters move
into one block laid out as the shards' params tables, so that a load is one copy a
shard: 88k instructions a step → 34k for the MLP's, by callgrind). Where the schedule
gathers the gradient every step and each tensor lies whole in one table, backward writes
the gradients straight into the tables of the slot the step is computed for
(`bind_grads`), and the gather copies nothing.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from .config import ConfigError
from .sharding import TABLES, Piece, ShardMap, grad_of, model_tensors


def runs(pieces: list[Piece]) -> list[tuple[str, int, int]]:
    """(tensor name, start, length) of a shard table's pieces in table order, a piece
    that continues the previous one in the same tensor merged into it."""
    out: list[tuple[str, int, int]] = []
    for p in pieces:
        if out and out[-1][0] == p.name and out[-1][1] + out[-1][2] == p.start:
            out[-1] = (p.name, out[-1][1], out[-1][2] + p.length)
        else:
            out.append((p.name, p.start, p.length))
    return out


def pick_device(spec: str, local_rank: int = 0, name: str = "--device") -> torch.device:
    """`--device`: auto (GPU local_rank % GPUs where there is CUDA, else the CPU), cpu,
    cuda (GPU local_rank % GPUs) or cuda:N; a ConfigError naming it (as `name`) if it is
    none of these, or no CUDA is here."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:   # not a device string torch knows
        raise ConfigError(f"{name} {spec!r} is not a device: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):   # mps, xpu, meta: the tables stay there, and the first send fails
        raise ConfigError(f"{name} {spec!r}: psgd trains on cpu or cuda (cuda or cuda:N), not on {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name} {spec}: CUDA is not available on this machine ({why_no_cuda()})")
    if dev.type == "cuda" and dev.index is None:
        # a GPU, as auto picks one (psgd.device() gave `cuda`, no index: the model of every worker of
        # `psgd run --device cuda` on cuda:0 of a machine of several, and a script's `model.to(psgd.device())`
        # compared unequal to where its parameters lay, cuda:0)
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev


def why_no_cuda() -> str:
    """Why torch has no CUDA here: a CPU-only build of torch (a GPU machine's nvidia-smi
    shows the GPU, and the user looks for a driver problem there is not), or a CUDA build
    that sees no GPU."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch "
                f"to train on a GPU")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda or torch.version.hip}) sees no GPU: no "
            f"driver, or CUDA_VISIBLE_DEVICES hides them")


def check_device(spec: str, local_rank: int = 0) -> torch.device:
    """`pick_device`, and a ConfigError naming --device unless torch can compute on it
    here (a job's or a simulation's: checked before anything starts; a worker's and the
    evaluator's, before they join the job); the device."""
    dev = pick_device(spec, local_rank)
    try:
        float(torch.ones(1, device=dev).sum())
    except Exception as e:  # a device torch names but cannot use here: cuda:N past the last, hpu without its module
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"--device {spec}: torch cannot compute on it on this machine ({reason})") from None
    return dev


def make_contiguous(model: nn.Module) -> None:
    """Every parameter and buffer of `model` in one contiguous block of its own memory
    (a transposed weight is not), so that the replica can write a shard's values into it
    in place through flat views. Values, and the Parameter objects (an optimizer's), are
    kept."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and not b.is_contiguous():
                    module._buffers[name] = b.contiguous()


_TAGS = {(kind, slot): f"{kind}{slot}" for kind in "bg" for slot in range(2)}


def _tag(kind: str, slot: int) -> str:
    """The buffers' key of a gather's `kind` (b: buffers, g: gradients) and slot (no string built per step)."""
    return _TAGS.get((kind, slot)) or f"{kind}{slot}"


def _grad_off(fn: Callable) -> Callable:
    """`fn` with gradient mode off, switched by hand: `@torch.no_grad()`'s context object
    costs more than the gather of a small model's step."""
    @functools.wraps(fn)
    def off(*args, **kwargs):
        was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(was)
    return off


class OverlapUnsafe(ConfigError):
    """A push from backward's hooks (`wire.overlap`) left before its gradient was whole."""


def flat_layout(shard_map: ShardMap, num_shards: int) -> list[tuple[str, int]] | None:
    """(tensor name, offset) of each trainable parameter in one flat block whose every
    shard's params table is a slice (the tables one after the other, shard by shard), or
    None when the map does not allow one: a tensor whose pieces are not adjacent in it."""
    offsets: dict[str, int] = {}
    at, last = 0, None   # last: (name, end) of the run before
    for i in range(num_shards):
        for name, start, length in runs(shard_map.pieces_of(i, "params")):
            if last is not None and last[0] == name and last[1] == start:   # a tensor cut across two shards
                pass
            elif start != 0 or name in offsets:
                return None
            else:
                offsets[name] = at
            last = (name, start + length)
            at += length
    return list(offsets.items())


class Replica:
    def __init__(self, model: nn.Module, num_shards: int, device: torch.device, flat: bool = False,
                 placement: str = "balanced"):
        """`flat`: the model's trainable parameters are moved into one block, each shard's
        params table a slice of it (`flat_layout`), so that `load` writes a shard's answer
        with one copy, not a split and a copy per tensor. Only for a model that is psgd's
        own: a script's may hold its tensors (`.data`) elsewhere, which would stop being
        the model's. `placement`: the shard map's (`Config.placement`)."""
        self.model = model.to(device)
        make_contiguous(self.model)
        self.device = device
        self.map = ShardMap.for_model(self.model, num_shards, placement)
        # shard -> its params table as a view of the model's flat block (`flat`), where there is one
        self._flat = self._flatten(num_shards) if flat else {}
        self.tensors = model_tensors(self.model)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.n = num_shards
        self._runs = {(i, t): runs(self.map.pieces_of(i, t)) for i in range(num_shards) for t in TABLES}
        with torch.no_grad():  # where `load` writes: (views of the model's tensors, their lengths)
            self._views = {key: ([self.tensors[name].view(-1)[start:start + length] for name, start, length in rs],
                                 [length for _, _, length in rs]) for key, rs in self._runs.items()}
        self._bufs: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (device, host) per table
        self._gplans: dict[tuple[str, int], tuple] = {}   # (tag, shard) -> `grads`' work for it (`_gplan`)
        # What a gather takes of each tensor, per (shard, table): (name, None, None) for a run that is the
        # whole tensor (no slice to make every step), else (name, start, end)
        self._cuts = {key: [(name, None, None) if start == 0 and length == self.tensors[name].numel()
                            else (name, start, start + length) for name, start, length in rs]
                      for key, rs in self._runs.items()}
        self._bufferless = not any(self.map.size(i, "buffers") for i in range(num_shards))
        self._empty: dict[int, list[torch.Tensor]] = {}   # slot -> a bufferless model's buffers tables
        # `load`'s work per table: (shard, its views, their lengths) of the shards whose part is not empty
        self._loads = {table: [(i, *self._views[(i, table)]) for i in range(num_shards) if self._views[(i, table)][0]]
                       for table in TABLES}
        # slot -> (its gradient tables, (parameter, its gradient's view in them) each) where backward
        # writes the gradients in place (`bind_grads`)
        self._bound: dict[int, tuple[list[torch.Tensor], list[tuple[nn.Parameter, torch.Tensor]]]] = {}
        self._ready: Callable[[int], None] | None = None   # `arm`'s, while armed
        self._shards_of: list[tuple[int, ...]] = []   # per trainable parameter, the shards it lies in (`hook_backward`)
        self._times: list[int] = []      # per trainable parameter, its hook's calls in this backward
        self._learned: list[int] | None = None   # its hook's calls in the first armed backward (`disarm`)
        self._need: list[float] = []     # per shard, its parameters' learned calls (inf: never from a hook)
        self._left: list[float] = []     # per shard, its parameters' hook calls still to come in this backward
        self._sent: list[bool] = []      # per shard, whether `ready` was called for it in this backward
        self._again: str = ""            # a parameter whose hook ran past its learned calls after its push left

    @torch.no_grad()
    def _flatten(self, num_shards: int) -> dict[int, torch.Tensor]:
        """Put the trainable parameters into one float32 block on the device, in the order
        of the shards' params tables (values and Parameter objects kept: `p.data` becomes a
        view of the block); each shard's table as a view of it. Nothing is moved ({}) if the
        map allows no such block or a parameter is not float32."""
        layout = flat_layout(self.map, num_shards)
        params = dict(self.model.named_parameters())
        if not layout or any(params[name].dtype != torch.float32 for name, _ in layout):
            return {}
        total = sum(self.map.size(i, "params") for i in range(num_shards))
        block = torch.empty(total, device=self.device)
        for name, at in layout:
            p = params[name]
            view = block[at:at + p.numel()]
            view.copy_(p.data.reshape(-1))
            p.data = view.view(p.shape)
        tables, at = {}, 0
        for i in range(num_shards):
            size = self.map.size(i, "params")
            if size:
                tables[i] = block[at:at + size]
            at += size
        return tables

    def bind_grads(self, slots: int = 2) -> bool:
        """Let backward write the gradients into the tables `grads` gives (DDP's
        `gradient_as_bucket_view`): before each compute, `clear_grads(slot)` zeroes that
        slot's block and makes each trainable parameter's `.grad` a view of it, so that a
        gather copies nothing. A gradient computed into slot s overwrites the tables
        gathered in slot s before: a caller computes into a slot whose tables it no
        longer needs (one `grads(slot)` would overwrite anyway). Only for a model whose
        parameters lie in one block (`flat`) on the CPU; whether it is on. Every
        parameter then has a gradient, zeros where backward gave it none: what `grads`
        sends for it either way."""
        if not self._flat or self.device.type != "cpu":
            return False
        whole = [(i, name) for i in range(self.n) for name, start, _ in self._cuts[(i, "params")] if start is None]
        if len(whole) != len(self.trainable):   # a tensor cut across two shards' tables: no one table holds it
            return False
        for slot in range(slots):
            tables = [self._buffers_for(_tag("g", slot), i, "params")[0] for i in range(self.n)]
            views, at = [], [0] * self.n
            for i, name in whole:
                p = self.trainable[name]
                views.append((p, tables[i][at[i]:at[i] + p.numel()].view(p.shape)))
                at[i] += p.numel()
            self._bound[slot] = (tables, views)
        return True

    def hook_backward(self) -> None:
        """Let backward tell when each shard's gradients are made (`wire.overlap`): a
        hook on every trainable parameter, run each time a gradient is accumulated into
        it, counts down its shards'. `arm(ready)` before a backward has `ready(shard)`
        called as soon as the last of the shard's parameters got its gradient, while
        backward goes on to the layers before; `disarm` after it names the shards not
        called (one that holds no parameter, or one of whose parameters got no gradient).

        How often each parameter's hook runs in a backward is learned from the first armed
        one, which calls `ready` for no shard (DDP's `static_graph` does the same): a
        parameter used in two segments of a reentrant activation checkpoint, say, gets
        its gradient in two parts, and a push after the first carried only part of it."""
        shards_of: dict[str, set[int]] = {}
        for piece in self.map.pieces:
            if piece.table == "params":
                shards_of.setdefault(piece.name, set()).add(piece.shard)
        self._shards_of = [tuple(sorted(shards_of[name])) for name in self.trainable]
        self._times = [0] * len(self.trainable)
        for k, p in enumerate(self.trainable.values()):
            p.register_post_accumulate_grad_hook(functools.partial(self._made, k))

    def _made(self, k: int, _param: torch.Tensor) -> None:
        ready = self._ready
        if ready is None:
            return
        self._times[k] += 1
        learned = self._learned
        if learned is None:   # the first armed backward: counted only
            return
        shards = self._shards_of[k]
        if self._times[k] > learned[k]:   # more parts than learned: its shards are sent after backward
            for i in shards:
                if self._sent[i] and not self._again:
                    self._again = list(self.trainable)[k]
                self._left[i] = math.inf
            return
        left = self._left
        for i in shards:
            left[i] -= 1
            if left[i] == 0:
                self._sent[i] = True
                ready(i)

    def arm(self, ready: Callable[[int], None]) -> None:
        """`ready(shard)` once each shard's gradients are made by the next backward (`hook_backward`)."""
        self._times[:] = [0] * len(self._times)
        self._sent = [False] * self.n
        self._again = ""
        self._left = list(self._need)
        self._ready = ready

    def disarm(self) -> list[int]:
        """The shards `arm`'s `ready` was not called for; no more calls. Raises
        `OverlapUnsafe` if a parameter's hook ran more often than learned after its
        shard's push had left (it left with part of the gradient)."""
        self._ready = None
        if self._learned is None:
            self._learn(list(self._times))
        if self._again:
            raise OverlapUnsafe(f"wire.overlap: {self._again}'s gradient was accumulated more often in this backward "
                                f"than in the first, after its shard's push had left with part of it (a model whose "
                                f"graph changes from step to step); train this model with wire.overlap = false")
        return [i for i in range(self.n) if not self._sent[i]]

    def _learn(self, learned: list[int]) -> None:
        """Keep each parameter's hook calls in a backward, and each shard's total of them:
        never from a hook (inf) for a shard with a parameter that got none, or with none."""
        self._learned = learned
        need = [0.0] * self.n
        for k, shards in enumerate(self._shards_of):
            for i in shards:
                need[i] += learned[k] if learned[k] else math.inf
        self._need = [x if x else math.inf for x in need]

    def clear_grads(self, slot: int = 0) -> None:
        """Before a step's backward: its gradients go into slot `slot`'s tables, zeroed
        (`bind_grads`), or, where they are not bound, start from none
        (`zero_grad(set_to_none=True)`)."""
        bound = self._bound.get(slot)
        if bound is None:
            self.model.zero_grad(set_to_none=True)
            return
        tables, views = bound
        for t in tables:
            t.zero_()
        for p, v in views:
            if p.grad is not v:
                p.grad = v

    def _bound_tables(self, slot: int) -> list[torch.Tensor] | None:
        """Slot `slot`'s tables if backward wrote this step's gradients into them: every
        parameter's `.grad` is still its view in them, as `clear_grads(slot)` made it (a
        step computed into another slot, or anything that set a new one, as
        `zero_grad(set_to_none=True)` or an accumulation out of place does, is gathered by
        a copy instead)."""
        bound = self._bound.get(slot)
        if bound is None:
            return None
        tables, views = bound
        for p, v in views:
            if p.grad is not v:
                return None
        return tables

    def _buffers_for(self, tag: str, shard: int, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tag, shard)
        if key not in self._bufs:
            size = self.map.size(shard, table)
            dev = torch.empty(size, device=self.device)
            host = torch.empty(size, pin_memory=True) if self.device.type == "cuda" else dev
            self._bufs[key] = (dev, host)
        return self._bufs[key]

    def _tables(self, tensors: dict, table: str, tag: str, shards: Iterable[int] | None = None) -> list[torch.Tensor]:
        """Shard by shard (`shards`, every one by default), its `table` gathered from `tensors`."""
        tables = []
        bufs = self._bufs
        for i in range(self.n) if shards is None else shards:
            pair = bufs.get((tag, i))
            dev, host = pair if pair is not None else self._buffers_for(tag, i, table)
            parts = [tensors[name].reshape(-1) if start is None else tensors[name].reshape(-1)[start:end]
                     for name, start, end in self._cuts[(i, table)]]
            if parts:
                torch.cat(parts, out=dev)
            tables.append((dev, host))
        return self._on_host(tables)

    def _on_host(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The host buffers of gathered (device, host) tables, copied there from the device's."""
        out = []
        for dev, host in tables:
            if host is not dev:
                host.copy_(dev, non_blocking=True)
            out.append(host)
        if self.device.type == "cuda":  # the copies run on the stream of the replica's GPU, not the current one's
            torch.cuda.current_stream(self.device).synchronize()
        return out

    @_grad_off
    def params(self) -> list[torch.Tensor]:
        return self._tables(self.tensors, "params", "p")

    def buffers(self, slot: int = 0, shards: Sequence[int] | None = None) -> list[torch.Tensor]:
        """`slot`: another set of buffers, for a second push in flight; `shards`: those
        shards' tables only, in that order. A model without buffers (an MLP) has only
        empty tables: made once, with nothing to gather each step."""
        if self._bufferless:
            tables = self._empty.get(slot)
            if tables is None:
                tables = self._empty[slot] = self._gather_buffers(slot)
            return tables if shards is None else [tables[i] for i in shards]
        return self._gather_buffers(slot, shards)

    @_grad_off
    def _gather_buffers(self, slot: int, shards: Sequence[int] | None = None) -> list[torch.Tensor]:
        return self._tables(self.tensors, "buffers", _tag("b", slot), shards)

    @_grad_off
    def grads(self, slot: int = 0, shards: Sequence[int] | None = None) -> list[torch.Tensor]:
        """(zeros where a trainable parameter got no gradient; a sparse one, nn.Embedding(sparse=True)'s,
        made dense: the tables are); `shards`: those shards' tables only, in that order."""
        bound = self._bound_tables(slot) if self._bound else None
        if bound is not None:
            return bound if shards is None else [bound[i] for i in shards]
        tag = _tag("g", slot)
        tables = []
        strided = torch.strided
        for i in range(self.n) if shards is None else shards:
            plan = self._gplans.get((tag, i))
            if plan is None:
                plan = self._gplan(tag, i)
            dev, host, params, cuts, views = plan
            if views:
                grads = []
                for p, (start, end) in zip(params, cuts, strict=True):
                    g = p.grad
                    if g is None or g.layout != strided:
                        g = grad_of(p)
                    grads.append(g if start is None else g.reshape(-1)[start:end])
                torch._foreach_copy_(views, grads)
            tables.append((dev, host))
        return self._on_host(tables)

    def _gplan(self, tag: str, shard: int) -> tuple:
        """A gradient gather's work for shard `shard` into the buffers of `tag`, made once: (device buffer,
        host buffer, each run's parameter, its (start, end) or (None, None) for the whole tensor, the
        buffer's view it is copied into: shaped as the parameter for a whole one, so that a step copies
        every gradient in one `torch._foreach_copy_`, without flattening or concatenating them)."""
        dev, host = self._buffers_for(tag, shard, "params")
        params, cuts, views, at = [], [], [], 0
        for name, start, end in self._cuts[(shard, "params")]:
            p = self.trainable[name]   # (the params table holds the trainable parameters only)
            n = p.numel() if start is None or end is None else end - start
            params.append(p)
            cuts.append((start, end))
            views.append(dev[at:at + n].view(p.shape) if start is None else dev[at:at + n])
            at += n
        plan = self._gplans[(tag, shard)] = (dev, host, params, cuts, views)
        return plan

    @_grad_off
    def load(self, params: list[torch.Tensor] | None, buffers: list[torch.Tensor] | None = None) -> None:
        cpu = self.device.type == "cpu"   # (a table from the wire is on the CPU already: no `.to` to ask)
        for table, flats in (("params", params), ("buffers", buffers)):
            if flats is None:
                continue
            if table == "params" and self._flat:   # a shard's table is one slice of the model's block
                for i, block in self._flat.items():
                    block.copy_(flats[i], non_blocking=True)
                continue
            for i, views, lengths in self._loads[table]:
                flat = flats[i] if cpu else flats[i].to(self.device, non_blocking=True)
                torch._foreach_copy_(views, flat.split_with_sizes(lengths), non_blocking=True)

    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with every tensor on the CPU: what a saved model.pt holds,
        so that `torch.load(path, weights_only=True)` reads it on a machine without a GPU."""
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if self._flat:   # (a parameter in the block, saved as a view of it, would save the whole block)
            state = {k: v.clone() for k, v in state.items()}
        return state

    def score(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) in eval mode; restores the previous mode."""
        return self.score_batches((x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y), batch_size))

    @torch.no_grad()
    def score_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """`score` over (x, y) batches as they come (a streamed test set)."""
        was = self.model.training
        self.model.eval()
        correct, loss, n = 0, 0.0, 0
        try:
            for xb, yb in batches:
                xb, yb = xb.to(self.device), yb.to(self.device)
                out = self.model(xb)
                loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
                correct += (out.argmax(1) == yb).sum().item()
                n += len(yb)
        finally:
            self.model.train(was)
        return correct / max(1, n), loss / max(1, n)
