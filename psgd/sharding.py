"""The shard map: which tensor, or chunk of a tensor, lives on which shard.

Every party computes the same map from the model and the shard count, with no
communication:

1. Entries are the model's trainable parameters (table "params") and its floating-point
   buffers such as BatchNorm running statistics (table "buffers"), all float32.
2. A tensor larger than the chunk size (a quarter of the model's mean share per shard,
   at least MIN_CHUNK elements) is split into near-equal chunks.
3. Pieces go largest-first onto the least-loaded shard by bytes; ties go to the lower
   shard index, and equal pieces are ordered by name and offset.

That is the "balanced" placement. The "layers" placement (`wire.overlap`) keeps tensors
whole and gives each shard a run of them in the model's order, the last layers on the
last shard: backward makes the gradients of a shard's tensors one after the other, and
the shard's push can leave as soon as they are made (DDP's buckets). The runs are as
even as whole tensors allow: their largest is the least it can be (`runs_of`).

On a shard, each table is one flat float32 vector: the shard's pieces in map order.
`gather` builds that vector from a model's tensors; `scatter` writes it back.
"""
from __future__ import annotations

import functools
import hashlib
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

MIN_CHUNK = 1024  # elements
TABLES = ("params", "buffers")
PLACEMENTS = ("balanced", "layers")


@dataclass(frozen=True)
class Piece:
    name: str       # tensor name in the state_dict
    table: str      # "params" or "buffers"
    start: int      # first element of the tensor (flattened) that this piece holds
    length: int     # elements
    shard: int
    offset: int     # position in the shard's flat table


class ShardMap:
    def __init__(self, entries: Iterable[tuple[str, str, int]], num_shards: int, placement: str = "balanced"):
        """entries: (name, table, numel) in a fixed order (the model's); placement: one of
        PLACEMENTS (the module's docstring)."""
        if num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.num_shards = num_shards
        self.placement = placement
        entries = list(entries)
        # what a checkpoint's tables are of (names, tables, sizes in order, and the placement where it is
        # not the first one's): a model changed since, its tables' sizes kept (a layer renamed), is told
        # by it (Shard.state_dict), and so are tables placed otherwise
        what = repr([tuple(e) for e in entries]) + ("" if placement == "balanced" else f"/{placement}")
        self.digest = hashlib.sha256(what.encode()).hexdigest()[:16]
        total = sum(n for _, _, n in entries)
        self.chunk = max(MIN_CHUNK, math.ceil(total / (4 * num_shards)))
        assigned = (self._layers(entries, num_shards) if placement == "layers"
                    else self._balanced(entries, num_shards, self.chunk))
        order = {name: i for i, (name, _, _) in enumerate(entries)}
        assigned.sort(key=lambda r: (r[4], TABLES.index(r[1]), order[r[0]], r[2]))
        self.pieces: list[Piece] = []
        self.sizes = {t: [0] * num_shards for t in TABLES}
        for name, table, start, length, shard in assigned:
            self.pieces.append(Piece(name, table, start, length, shard, self.sizes[table][shard]))
            self.sizes[table][shard] += length
        self._by: dict[tuple[int, str], list[Piece]] = {(s, t): [] for s in range(num_shards) for t in TABLES}
        for piece in self.pieces:   # one pass (a scan per shard was O(shards x pieces))
            self._by[(piece.shard, piece.table)].append(piece)

    @staticmethod
    def _balanced(entries: list[tuple[str, str, int]], num_shards: int,
                  chunk: int) -> list[tuple[str, str, int, int, int]]:
        """(name, table, start, length, shard) of every piece: tensors cut into chunks,
        largest first onto the least-loaded shard."""
        raw = []
        for name, table, numel in entries:
            parts = max(1, math.ceil(numel / chunk))
            base, extra = divmod(numel, parts)
            start = 0
            for p in range(parts):
                length = base + (1 if p < extra else 0)
                raw.append((name, table, start, length))
                start += length
        raw.sort(key=lambda r: (-r[3], r[0], r[2]))
        heap = [(0, s) for s in range(num_shards)]
        assigned = []
        for name, table, start, length in raw:
            load, shard = heapq.heappop(heap)
            assigned.append((name, table, start, length, shard))
            heapq.heappush(heap, (load + 4 * length, shard))
        return assigned

    @staticmethod
    def _layers(entries: list[tuple[str, str, int]], num_shards: int) -> list[tuple[str, str, int, int, int]]:
        """The same, whole tensors in the model's order, each table cut into `num_shards`
        runs (`runs_of`)."""
        assigned = []
        for table in TABLES:
            named = [(name, numel) for name, t, numel in entries if t == table]
            shards = runs_of([numel for _, numel in named], num_shards)
            assigned += [(name, table, 0, numel, shard) for (name, numel), shard in zip(named, shards, strict=True)]
        return assigned

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_shards: int, placement: str = "balanced") -> ShardMap:
        return shard_map(tuple(model_entries(model)), num_shards, placement)

    def pieces_of(self, shard: int, table: str) -> list[Piece]:
        return self._by[(shard, table)]

    def size(self, shard: int, table: str) -> int:
        return self.sizes[table][shard]

    def bytes_per_shard(self) -> list[int]:
        return [4 * (self.sizes["params"][s] + self.sizes["buffers"][s]) for s in range(self.num_shards)]

    @torch.no_grad()
    def gather(self, tensors: dict[str, torch.Tensor], shard: int, table: str,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The shard's flat float32 table built from full tensors (name -> tensor)."""
        parts = [tensors[p.name].reshape(-1)[p.start:p.start + p.length] for p in self.pieces_of(shard, table)]
        if out is None:
            return torch.cat(parts).float() if parts else torch.zeros(0)
        if parts:
            torch.cat(parts, out=out)
        return out

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor, shard: int, table: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write a shard's flat table back into full tensors (in place)."""
        for p in self.pieces_of(shard, table):
            dst = tensors[p.name]
            src = flat[p.offset:p.offset + p.length]
            dst.view(-1)[p.start:p.start + p.length].copy_(src.to(dst.dtype), non_blocking=True)

    def describe(self) -> str:
        cut = (f"chunk {self.chunk} elements" if self.placement == "balanced"
               else "whole tensors in the model's order (wire.overlap)")
        lines = [f"shard map: {self.num_shards} shard(s), {cut}"]
        span = max((len(f"[{p.start}:{p.start + p.length}]") for p in self.pieces), default=0)   # one column
        for s in range(self.num_shards):
            lines.append(f"shard {s}: {self.bytes_per_shard()[s]:,} bytes "
                         f"(params {self.sizes['params'][s]:,}, buffers {self.sizes['buffers'][s]:,} elements)")
            for p in self.pieces_of(s, "params") + self.pieces_of(s, "buffers"):
                lines.append(f"  {p.table:<7} {p.name:<40} {f'[{p.start}:{p.start + p.length}]':<{span}} "
                             f"{4 * p.length:>12,} B")
        idle = self.idle_note()
        return "\n".join(lines + ([idle] if idle else []))

    def idle_note(self) -> str:
        """What `psgd shards` says of the shards that hold no part of the model, or '':
        their processes start and serve nothing (a worker still exchanges with each, every
        step). A job's coordinator warns of them (`Coordinator._idle_shards`)."""
        empty = [s for s, n in enumerate(self.bytes_per_shard()) if n == 0]
        if not empty:
            return ""
        return (f"{len(empty)} of the {self.num_shards} shards hold no part of the model "
                f"({', '.join(map(str, empty))}): it is cut into only {len(self.pieces)} pieces (its tensors, "
                + (f"split into chunks of up to {self.chunk} elements" if self.placement == "balanced" else
                   "kept whole by wire.overlap")
                + f"); cluster.servers = {self.num_shards - len(empty)} serves it with fewer processes")


def runs_of(sizes: list[int], parts: int) -> list[int]:
    """The part of each of `sizes`, cut in order into at most `parts` runs whose largest
    sum is the least it can be (a binary search on it; each run filled up to it), and
    into `parts` runs where there are as many sizes: none left empty."""
    if not sizes:
        return []
    def needs(cap: int) -> int:   # the runs that filling each up to `cap` makes
        count, load = 1, 0
        for size in sizes:
            if load and load + size > cap:
                count, load = count + 1, 0
            load += size
        return count
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if needs(mid) <= parts else (mid + 1, hi)
    out, part, load, taken = [], 0, 0, 0   # taken: the sizes in the current run
    for k, size in enumerate(sizes):
        if taken and (load + size > lo or len(sizes) - k <= parts - 1 - part):
            part, load, taken = part + 1, 0, 0
        out.append(part)
        load += size
        taken += 1
    return out


@functools.lru_cache(maxsize=8)
def shard_map(entries: tuple[tuple[str, str, int], ...], num_shards: int, placement: str = "balanced") -> ShardMap:
    """The ShardMap of `entries` over `num_shards`, one for every caller in a process (read
    only once built): a map holds O(num_shards), and psgd simulate's S shards and W
    workers each built their own (20,000 shards took 24 GB)."""
    return ShardMap(entries, num_shards, placement)


def model_entries(model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(name, table, numel): trainable parameters, then floating-point buffers.

    Frozen parameters (requires_grad=False) and non-float buffers (BatchNorm's
    num_batches_tracked) are not sharded: every party must build them alike (psgd's
    own models from the seed); `model_layout` carries a fingerprint of their values, so
    the coordinator refuses a worker whose differ.
    """
    out = [(n, "params", p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    out += [(n, "buffers", b.numel()) for n, b in model.named_buffers() if b.is_floating_point()]
    return out


def model_layout(model: torch.nn.Module) -> list[list]:
    """The model's layout (psgd/layout.py): [name, table, shape, dtype] per entry of
    `model_entries`, in its order, then [name, "fixed", shape, dtype, fingerprint] per
    tensor that the map does not cover (`fixed_tensors`)."""
    tensors = model_tensors(model)

    def dtype(t: torch.Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")
    return ([[name, table, list(tensors[name].shape), dtype(tensors[name])] for name, table, _ in model_entries(model)]
            + [[name, "fixed", list(t.shape), dtype(t), fingerprint(t)] for name, t in fixed_tensors(model).items()])


def fixed_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor for what the map does not cover: frozen parameters, then
    non-float buffers."""
    out: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    out.update({n: b for n, b in model.named_buffers() if not b.is_floating_point()})
    return out


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> str:
    """A hash of a tensor's values (its bytes): equal tensors have equal fingerprints."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=12).hexdigest()


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor for everything the map covers (parameters and buffers, live)."""
    d: dict[str, torch.Tensor] = dict(model.named_parameters())
    d.update({n: b for n, b in model.named_buffers()})
    return d


def model_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> gradient (zeros where a trainable parameter got none; a sparse one,
    nn.Embedding(sparse=True)'s, made dense: the tables are)."""
    return {n: grad_of(p) for n, p in model.named_parameters() if p.requires_grad}


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """A trainable parameter's gradient, dense (zeros where it got none)."""
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad if p.grad.layout == torch.strided else p.grad.to_dense()
