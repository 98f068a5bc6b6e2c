"""Optimizers and learning-rate schedules (server-side, and local for easgd, ltfb and diloco).

`make_optimizer` wraps torch.optim (SGD with momentum/Nesterov/weight decay, Adam,
AdamW) around flat tensors. `lr_at` is the schedule: linear warm-up over
`warmup_steps`, then constant, step (x gamma every step_size) or cosine (to min_lr at
`total` steps). Steps are counted in worker steps, so a shard that applies one update
per push (ssp, async) advances the schedule by 1/W per update.

torch.optim's optimizers import torch._dynamo (torch.compile) on first use, to mark
their methods as not to be compiled: measured 1.9 s of CPU, about as long as importing
torch, in every shard and worker, which on a 2-core machine is most of the start-up of
a job after torch itself. psgd never compiles an optimizer, so `make_optimizer` returns
a subclass whose methods call the same torch.optim code without those marks (`eager`):
the same arithmetic, state_dict and hooks (tests/test_startup.py checks both). Its step
runs the step hooks itself, without the `record_function` that torch.optim wraps around
every step for its profiler (an op dispatch: about half of a 26k-parameter SGD step's
~100 us on a shard). For one CPU tensor with no step hook (a shard's table) SGD's and
Adam/AdamW's step calls the kernel that torch's step calls on it (`torch._fused_sgd_`,
`_fused_adam(w)_`, plain SGD's `add_`) without torch's ~15 Python calls that group one
tensor by device and dtype; the first step, which makes the state, is torch's own
(tests/test_optim_fast.py: the values and state bit for bit torch's). Where
torch._dynamo is already loaded (a user's model compiled), or torch's layout is not the
expected one, the plain torch.optim class is used.
"""
from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from itertools import chain
from typing import Any, TypeVar, cast

import torch

from .config import OptimizerConfig

_MARKED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")  # @torch._disable_dynamo
_EAGER: dict[type, type] = {}
Opt = TypeVar("Opt", bound=torch.optim.Optimizer)


def _unmarked(fn: Any) -> Any:
    """A method of torch.optim.Optimizer without its `torch._disable_dynamo` wrapper."""
    raw = fn.__wrapped__

    def method(self, *args, **kwargs):
        return raw(self, *args, **kwargs)

    method.__name__, method.__doc__ = fn.__name__, fn.__doc__
    return method


def eager(cls: type[Opt]) -> type[Opt]:
    """cls with its step and the Optimizer methods that import torch._dynamo calling the
    code they wrap: the step in the grad mode its wrapper sets (`differentiable`, off by
    default), without `torch._dynamo.graph_break()` (a no-op outside torch.compile), and
    the step hooks that torch's `profile_hook_step` would run, without its profiler range."""
    if cls in _EAGER:
        return cast("type[Opt]", _EAGER[cls])
    base = torch.optim.Optimizer
    step = getattr(cls.step, "__wrapped__", None)
    hooks = sys.modules[base.__module__]  # torch.optim.optimizer: the global step hooks
    if (step is None or "torch._dynamo" in sys.modules
            or not hasattr(hooks, "_global_optimizer_pre_hooks") or not hasattr(hooks, "_global_optimizer_post_hooks")
            or any(getattr(getattr(base, n), "__wrapped__", None) is None for n in _MARKED)):
        return cls

    fast = _FAST.get(cls)

    def eager_step(self, *args, **kwargs):
        if fast is not None and not (args or kwargs or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                                     or hooks._global_optimizer_pre_hooks or hooks._global_optimizer_post_hooks):
            grad_was = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                done = fast(self)
            except KeyError:   # (another torch's groups, without a key it reads before any change: its own step)
                done = False
            finally:
                torch._C._set_grad_enabled(grad_was)
            if done:
                self._optimizer_step_code()
                return None
        for pre in chain(hooks._global_optimizer_pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
            result = pre(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            out = step(self, *args, **kwargs)
        self._optimizer_step_code()
        for post in chain(self._optimizer_step_post_hooks.values(), hooks._global_optimizer_post_hooks.values()):
            post(self, args, kwargs)
        return out

    eager_step.__doc__ = cls.step.__doc__
    eager_step.hooked = True  # type: ignore[attr-defined]  # Optimizer.__init__ must not wrap it in profile_hook_step
    namespace = {n: _unmarked(getattr(base, n)) for n in _MARKED}
    namespace.update(step=eager_step, __module__=__name__, __doc__=cls.__doc__)
    _EAGER[cls] = type(cls.__name__, (cls,), namespace)
    return cast("type[Opt]", _EAGER[cls])


def _one_param(opt: Any) -> tuple[dict, torch.Tensor, torch.Tensor] | None:
    """(group, param, grad) of an optimizer of one group of one CPU tensor with a dense
    gradient, stepped as torch steps it by default (not differentiable, no foreach, no
    grad scaling); None otherwise."""
    groups = opt.param_groups
    if len(groups) != 1:
        return None
    group = groups[0]
    params = group["params"]
    if len(params) != 1 or group["differentiable"] or group["foreach"] or type(group["lr"]) is not float:
        return None
    p = params[0]
    g = p.grad
    if (g is None or g.is_sparse or not p.is_cpu
            or getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None):
        return None
    return group, p, g


def _sgd_step(opt: Any) -> bool:
    """torch.optim.SGD.step's arithmetic for `_one_param`'s case, the kernel that torch's
    own step calls on the same tensors (fused: `torch._fused_sgd_`; plain SGD unfused:
    `param.add_(grad, alpha=-lr)`), without its ~15 Python calls that group one tensor by
    device and dtype. False (nothing done) where torch's step would do more: a first
    step (the momentum buffer made, the fused device check), maximize, another layout."""
    one = _one_param(opt)
    if one is None:
        return False
    group, p, g = one
    momentum, lr = group["momentum"], group["lr"]
    if group["fused"]:
        if getattr(opt, "_need_device_dtype_check_for_fused", True) or group["maximize"]:
            return False
        bufs = []
        if momentum != 0:
            state = opt.state.get(p)
            buf = None if state is None else state.get("momentum_buffer")
            if buf is None:
                return False
            bufs = [buf]
        torch._fused_sgd_([p], [g], bufs, weight_decay=group["weight_decay"], momentum=momentum, lr=lr,
                          dampening=group["dampening"], nesterov=group["nesterov"], maximize=False,
                          is_first_step=False, grad_scale=None, found_inf=None)
        return True
    if momentum != 0 or group["weight_decay"] != 0 or group["maximize"] or group["foreach"] is not None:
        return False
    p.add_(g, alpha=-lr)   # _single_tensor_sgd's (torch picks it for a CPU tensor: no foreach kernel)
    return True


def _adam_step(opt: Any) -> bool:
    """torch.optim.Adam/AdamW.step for `_one_param`'s case with fused kernels, as torch's
    `_fused_adam` calls them (`_foreach_add_` of the step count, then `_fused_adam_` or
    `_fused_adamw_`); False where torch's step would do more (the first step's state)."""
    one = _one_param(opt)
    if one is None:
        return False
    group, p, g = one
    state = opt.state.get(p)
    beta1, beta2 = group["betas"]
    if not state or not group["fused"] or group["capturable"] or type(beta1) is not float or type(beta2) is not float:
        return False
    amsgrad = group["amsgrad"]
    # (every key read before the step count changes: a group of another torch without one is stepped by torch)
    kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    lr, weight_decay, eps, maximize = group["lr"], group["weight_decay"], group["eps"], group["maximize"]
    moments = [state["exp_avg"]], [state["exp_avg_sq"]], [state["max_exp_avg_sq"]] if amsgrad else []
    steps = [state["step"]]
    torch._foreach_add_(steps, 1)
    kernel([p], [g], *moments, steps, amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
           eps=eps, maximize=maximize, grad_scale=None, found_inf=None)
    return True


# step() of torch's own classes (a subclass may step otherwise) taken by `eager`'s fast path
_FAST = {torch.optim.SGD: _sgd_step, torch.optim.Adam: _adam_step, torch.optim.AdamW: _adam_step}


def make_optimizer(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """`[optimizer]`'s optimizer over `params`: torch's fused implementation (one kernel
    over each tensor: on this project's machine 2-15x faster for a table of 0.3-4M
    values) where torch has one for the device, except plain SGD (no momentum, no weight
    decay), whose unfused step is one `add_` and faster."""
    if cfg.name == "sgd":
        kw: dict = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                    "nesterov": cfg.nesterov and cfg.momentum > 0}
        return _fused_if_offered(eager(torch.optim.SGD), params, kw, cfg.momentum > 0 or cfg.weight_decay > 0)
    cls = eager(torch.optim.Adam) if cfg.name == "adam" else eager(torch.optim.AdamW)
    kw = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    return _fused_if_offered(cls, params, kw, True)


def _fused_if_offered(cls: type[Opt], params: list[torch.Tensor], kw: dict, want: bool) -> Opt:
    if want:
        try:
            return cls(params, **{**kw, "fused": True})
        except (RuntimeError, ValueError, TypeError):  # no fused kernel for these tensors' device or dtype
            pass
    return cls(params, **kw)


def lr_at(cfg: OptimizerConfig, step: float, total: int) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return min(cfg.lr, cfg.lr * (step + 1) / cfg.warmup_steps)  # ssp/async: fractional steps, no overshoot
    if cfg.schedule == "step":
        return cfg.lr * cfg.gamma ** int(step // cfg.step_size)
    if cfg.schedule == "cosine" and total > cfg.warmup_steps:
        frac = min(1.0, (step - cfg.warmup_steps) / (total - cfg.warmup_steps))
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


# A float32 below this (2**-126) is denormal: the CPU computes on it in microcode
_TINIEST_NORMAL = 1.1754943508222875e-38


def flushing_denormals() -> bool:
    """Does this thread's CPU treat denormal floats as zero (DAZ, set with FTZ by
    `torch.set_flush_denormal`)? torch has no getter: a denormal times one says."""
    return bool((torch.tensor([_TINIEST_NORMAL / 4]) * 1.0).item() == 0.0)


@contextlib.contextmanager
def denormals_flushed(flush: bool) -> Iterator[None]:
    """`train.flush_denormal` on this thread (and the threads torch starts from it) for
    the block, as it was after. Denormals are the float32 values below 2**-126; on x86 an
    operation on one costs ~100 cycles. An MLP's momentum buffer fills with them as the
    model grows confident (2,201 of 26,122 values after 3,000 steps of the default job):
    its SGD step on a shard took 94 us against 19 us flushed, and a plain loop's steps
    slowed from 95k to 74k samples/s over 4,000 steps. Flushed, such a value is zero: a
    difference below 1e-38, which float32 training does not see (TensorFlow flushes by
    default)."""
    before = flush_denormals(flush)
    try:
        yield
    finally:
        flush_denormals(before)


def flush_denormals(flush: bool) -> bool:
    """`denormals_flushed` without the block: set it; whether they were flushed before."""
    before = flushing_denormals()
    if flush != before:
        torch.set_flush_denormal(flush)
    return before
