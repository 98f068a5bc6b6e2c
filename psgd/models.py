"""Models: `mlp`, `cnn`, `resnet20`, or a user factory `package.module:factory`.

Every party builds the model with the job's seed, so frozen parameters and integer
buffers agree everywhere without being sent. A factory is called as
`factory(input_shape=(C, H, W), num_classes=K)` and must return an `nn.Module` with
trainable parameters, all float32, whose output for a batch of N inputs is N x K logits
(built, it is run on a batch of zeros to check).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading

import torch
from torch import nn

from .config import ConfigError
from .layout import unfit_input

_SEEDING = threading.Lock()


class MLP(nn.Module):
    def __init__(self, input_shape, num_classes: int, hidden: int = 128):
        super().__init__()
        n_in = 1
        for d in input_shape:
            n_in *= d
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(n_in, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks with BatchNorm, global pooling, a linear head; for digits/MNIST."""

    def __init__(self, input_shape, num_classes: int, width: int = 32):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(2 * width * 4, num_classes)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:  # option B: 1x1 projection
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """The CIFAR ResNet of He et al. 2016 (n = 3: 6n + 2 = 20 layers), for 32x32x3 inputs."""

    def __init__(self, input_shape, num_classes: int = 10, n: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, c = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(BasicBlock(c, c_out, stride if i == 0 else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def _raised(e: BaseException, root: str | None) -> str:
    """`Type: message` of a user's exception on one line, with the file and line where it
    was raised in the user's package (under `root`), the deepest such frame: a data factory
    that raised printed a traceback, or its message alone ("/data/x.bin") without saying
    which factory, and one line must still say where to look."""
    said = f"{type(e).__name__}: {' '.join(str(e).split())}".rstrip(": ")
    where = None
    tb = e.__traceback__
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if root and os.path.abspath(f).startswith(root):
            where = (f, tb.tb_lineno)
        tb = tb.tb_next
    return f"{said} ({where[0]}, line {where[1]})" if where and not isinstance(e, SyntaxError) else said


def _package_root(module_name: str) -> str | None:
    """The folder of a module's top-level package, or the module's file: where its code is."""
    try:
        spec = importlib.util.find_spec(module_name.partition(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.join(os.path.abspath(list(spec.submodule_search_locations)[0]), "")
    return os.path.abspath(spec.origin) if spec.origin and os.path.isfile(spec.origin) else None


def load_factory(spec: str, what: str):
    """`package.module:factory` -> the callable, or a ConfigError that says what failed.
    What the factory raises when called, or the module when imported, is a ConfigError
    naming the factory (the user's exception chained: a log's traceback keeps it)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {spec!r}: expected a built-in name or package.module:factory")
    as_module = module_name.removesuffix(".py").replace("\\", "/").strip("./").replace("/", ".")
    not_a_name = (f"{what} {spec!r}: {module_name} is not a module's name: give it as Python imports it, "
                  f"e.g. {as_module}:{attr}")
    if module_name.startswith(".") or "/" in module_name or "\\" in module_name:   # a file's path, a relative name
        raise ConfigError(not_a_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if module_name.endswith(".py"):
            raise ConfigError(not_a_name) from None
        hint = ""
        if e.name == module_name.partition(".")[0]:   # the user's package itself, not found
            hint = "; psgd imports it from the folder it runs in and PYTHONPATH"
        raise ConfigError(f"{what} {spec!r}: cannot import {module_name} ({e}){hint}") from None
    except Exception as e:   # a syntax error, or the module's own code raised
        raise ConfigError(f"{what} {spec!r}: importing {module_name} raised "
                          f"{_raised(e, _package_root(module_name))}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {module_name} has no callable {attr!r}")
    root = _package_root(module_name)

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{what} {spec!r}: the factory raised {_raised(e, root)}") from e
    return factory


def _check_output(model: nn.Module, name: str, input_shape: tuple, num_classes: int) -> None:
    """A factory's model run on a batch of two zero inputs of the data's sample shape, on
    the device of its parameters (a factory may move its model to a GPU), in eval mode
    (restored) and without gradients, must give (2, num_classes)
    logits: what psgd's cross-entropy reads. The inputs are float32, as psgd's in-memory
    datasets give them, or, where that raises, integers (a streamed dataset's token ids).
    A model that did not fit the data failed every worker's first step, and the
    evaluator until psgd run gave up restarting it, each with a traceback; one with more
    outputs than classes trained with nothing said."""
    device = next(p for p in model.parameters() if p.requires_grad).device   # a factory's .cuda() model: there
    x = torch.zeros((2, *input_shape), device=device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            try:
                out = model(x)
            except Exception as e:
                try:
                    out = model(x.long())
                except Exception:
                    raise ConfigError(f"model.name {name!r}: the model fails on the data: a batch of 2 inputs of "
                                      f"shape {input_shape} (float32 zeros, on {device}) raised "
                                      f"{_raised(e, _package_root(name.partition(':')[0]))}") \
                        from e
    finally:
        for m, training in modes:
            m.training = training
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise ConfigError(f"model.name {name!r}: its output for a batch of 2 inputs of shape {input_shape} is {got}; "
                          f"psgd trains it with cross-entropy over the data's {num_classes} classes: it must be a "
                          f"tensor of shape (2, {num_classes})")


def build_model(name: str, input_shape, num_classes: int, seed: int, hidden: int = 128, check: bool = False
                ) -> nn.Module:
    """Build a model deterministically from the seed (same parameters on every party).
    `check`: a factory's is checked against the data (`_check_output`: a forward of two
    zero samples), with the seed still set: before a job starts (`cli.check_model`) and
    in the daemons that train or score it (started by hand, they see it first); not in
    every one of a simulation's replicas, nor in a shard's build, except for a model with a lazy
    layer, which that forward initializes."""
    input_shape = tuple(int(d) for d in input_shape)
    with _SEEDING, torch.random.fork_rng(devices=[]):  # the global RNG: one builder at a time
        torch.manual_seed(seed)
        model: nn.Module
        if name == "mlp":
            model = MLP(input_shape, num_classes, hidden)
        elif name in ("cnn", "resnet20"):
            unfit = unfit_input(name, input_shape)
            if unfit:
                raise ConfigError(unfit)
            model = (SmallCNN if name == "cnn" else ResNet20)(input_shape, num_classes)
        elif ":" in name:
            model = load_factory(name, "model.name")(input_shape=input_shape, num_classes=num_classes)
            if not isinstance(model, nn.Module):
                raise ConfigError(f"model.name {name!r}: the factory returned {type(model).__name__}, not nn.Module")
        else:
            raise ConfigError(f"model.name {name!r}: expected mlp, cnn, resnet20 or package.module:factory")
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:  # the shards would hold nothing: every worker's registration is refused
            raise ConfigError(f"model.name {name!r}: the model has no trainable parameters (none with "
                              f"requires_grad=True): psgd trains a model's trainable parameters")
        for p in trainable:
            if p.dtype != torch.float32:
                raise ConfigError(f"model.name {name!r}: trainable parameters must be float32, got {p.dtype}")
        # A lazy layer (nn.LazyLinear) gets its shapes, and its values from the seed, from a first forward:
        # the check's, which every party that builds the model must run alike (it was only the trainers' and
        # the evaluator's: psgd simulate, psgd shards and psgd compare's baseline failed on an uninitialized
        # parameter, with torch's traceback).
        lazy = any(nn.parameter.is_lazy(t) for t in (*model.parameters(), *model.buffers()))
        if (check and ":" in name) or lazy:
            _check_output(model, name, input_shape, num_classes)
    return model
