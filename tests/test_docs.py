"""The docs against the code: README's configuration table and the docs' key tables
against psgd/config.py, and README's command-line synopsis against the `psgd` parsers,
so that a key, a default or a flag cannot change in one place and not the other."""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import sys

import pytest

from psgd import config
from psgd.cli import parser

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(ROOT, "README.md")

# Defaults that a table states by what they mean rather than by the value.
MEANT = {"checkpoint.dir": "OUT/checkpoints"}


def defaults() -> dict:
    out = {}
    for section, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def split_top(text: str) -> list[str]:
    """'a, [1, 2], b' -> ['a', '[1, 2]', 'b']: commas outside brackets and braces."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur]]


def same(key: str, written: str, value) -> bool:
    """Whether a table's default cell `written` states `value`."""
    if key in MEANT:
        return written == MEANT[key]
    text = re.sub(r"\s*\(.*\)$", "", written.strip("`")).replace("−", "-")   # '0 (= 0.9/W)', a typeset minus
    if text == '""':
        return value == ""
    try:
        parsed = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = text.strip('"')   # a bare word: a string
    return parsed == value and type(parsed) is type(value) or (
        isinstance(value, float) and not isinstance(parsed, bool) and isinstance(parsed, (int, float))
        and float(parsed) == value)


def readme_table() -> dict[str, str]:
    """README's configuration table: dotted key -> its default cell."""
    text = open(README).read()
    start = text.index("| key | default | meaning |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        keys, section = [], ""
        for k in re.findall(r"`([^`]+)`", cells[0]):
            section = section if k.startswith(".") else k.split(".")[0]
            keys.append(section + k if k.startswith(".") else k)
        values = split_top(cells[1]) if len(keys) > 1 else [cells[1]]
        assert len(values) == len(keys), f"README: the row of {', '.join(keys)} gives {len(values)} defaults"
        out.update(zip(keys, values, strict=True))
    return out


def test_readme_config_table_has_every_key_with_its_default():
    table, code = readme_table(), defaults()
    assert sorted(set(code) - set(table)) == [], "config keys missing from README's configuration table"
    assert sorted(set(table) - set(code)) == [], "README's configuration table names keys psgd/config.py lacks"
    wrong = [f"{k}: README says {table[k]}, psgd/config.py {code[k]!r}" for k in code if not same(k, table[k], code[k])]
    assert wrong == []


def test_docs_key_tables_state_the_defaults():
    """Every row of a `| key | default | meaning |` table in docs/*.md (one key, or two
    keys and two defaults) states psgd/config.py's default."""
    code, wrong, seen = defaults(), [], 0
    row = re.compile(r"^\| `([a-z_]+\.[a-z_]+)`(?:, `([a-z_]+\.[a-z_]+)`)? \| ([^|]+) \|")
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        in_table = False
        for line in open(path):
            in_table = line.startswith("| key | default |") or in_table and line.startswith("|")
            m = row.match(line)
            if not in_table or line.startswith("| key |") or line.startswith("|---"):
                continue
            if not m or m.group(1).split(".")[0] not in config.SECTIONS:
                wrong.append(f"{os.path.basename(path)}: not a `section.key` row: {line.strip()}")
                continue
            keys = [k for k in m.group(1, 2) if k]
            cells = split_top(m.group(3).strip()) if len(keys) > 1 else [m.group(3).strip()]
            if len(cells) != len(keys) or not all(k in code for k in keys):
                wrong.append(f"{os.path.basename(path)}: {line.strip()}")
                continue
            for k, cell in zip(keys, cells, strict=True):
                seen += 1
                if not same(k, cell, code[k]):
                    wrong.append(f"{os.path.basename(path)}: {k} = {cell}, psgd/config.py {code[k]!r}")
    assert seen > 20   # (the tables are there: a changed layout does not pass by matching nothing)
    assert wrong == []


# Flags that README's synopsis leaves out on purpose.
UNLISTED = {("coordinator", "--launched-at")}   # psgd run passes it


def synopsis() -> dict[str, set[str]]:
    """README's "Command line" block: verb -> the flags it shows."""
    text = open(README).read()
    start = text.index("## Command line")
    block = text[text.index("```", start) + 3:]
    block = block[:block.index("```")]
    out: dict[str, set[str]] = {}
    verbs: list[str] = []
    for line in block.splitlines():
        m = re.match(r"psgd ([a-z|]+)", line)
        if m:
            verbs = m.group(1).split("|")
        for v in verbs:
            out.setdefault(v, set()).update(re.findall(r"(--[a-z][a-z-]*)", line))
    return out


def test_readme_command_line_synopsis_matches_the_parsers():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    shown = synopsis()
    assert set(shown) == set(sub.choices), "README's synopsis and `psgd --help` list different verbs"
    problems = []
    for verb, p in sub.choices.items():
        flags = {s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")}
        flags.discard("--help")
        problems += [f"psgd {verb} {f}: in README, not in the parser" for f in sorted(shown[verb] - flags)]
        problems += [f"psgd {verb} {f}: in the parser, not in README" for f in sorted(flags - shown[verb])
                     if (verb, f) not in UNLISTED]
    assert problems == []


VERBS = "run|compare|simulate|coordinator|server|worker|evaluator|shards|status|keys"
# A word that makes a command a template, not one to run as written.
PLACEHOLDER = re.compile(r"\.\.\.|[][|<>]|\b(?:FILE|DIR|HOST|SECTION|ROLE|NAME|OUT)\b|\bI\b")


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every `psgd VERB ...` that README, docs/*.md and the examples'
    docstrings show written out: lines of code blocks (a trailing `\\` joins the next line)
    and inline code spans with arguments (which may wrap across lines; not a name such as
    `psgd run` or `psgd run --timeout`), with arguments after `--` (a training script's) and
    templates (`psgd run [CONFIG] ...`, `--shard I`) left out."""
    out = []
    start = re.compile(rf"psgd (?:{VERBS})\b")
    for path in [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))),
                 *sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))]:
        text, name = open(path).read(), os.path.relpath(path, ROOT)
        fence = re.compile(r"```[a-z]*\n(.*?)```", re.S)
        blocks = [b for b in fence.findall(text)] if path.endswith(".md") else [text]
        spans = re.findall(r"`([^`]+)`", fence.sub("", text)) if path.endswith(".md") else []
        lines = [ln.split(" #")[0] for b in blocks for ln in re.sub(r"\\\n\s*", " ", b).splitlines()]
        at_start = re.compile(rf"^\s*(?:[A-Z_]+=\S* )*(?:\S*/)?({start.pattern}(?: .*)?)$")
        for cmd in [m.group(1) for ln in lines if (m := at_start.match(ln))] + \
                   [c for s in spans if start.match(c := " ".join(s.split()))
                    and " " in c[5:] and not c.split()[-1].startswith("--")]:  # (`psgd run --timeout`: names)
            cmd = cmd.split(" -- ")[0].strip()
            if not PLACEHOLDER.search(cmd):
                out.append((name, cmd))
    return out


def test_the_docs_commands_parse_and_their_settings_are_valid():
    """Every command the docs show written out is one `psgd` takes: its flags (the parser),
    its `--set` keys and values, and a compare's or simulate's `--modes` items and plan (as
    `psgd compare` builds them before it starts anything). A renamed flag, key or mode
    parameter would otherwise leave a command in the docs that fails as written."""
    import contextlib
    import io
    import shlex

    from psgd import compare
    commands, wrong = doc_commands(), []
    for name, cmd in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser().parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            wrong.append(f"{name}: {cmd}: {err.getvalue().strip().splitlines()[-1]}")
            continue
        try:
            path = getattr(args, "config", None)
            path = os.path.join(ROOT, path) if path and os.path.exists(os.path.join(ROOT, path)) else None
            if hasattr(args, "set"):
                base = config.load(path, args.set)
            if args.cmd in ("compare", "simulate") and args.modes:
                specs = compare.parse_modes(args.modes)
                compare.refuse_sets_an_item_overrides(args.set, specs)
                compare.build_plan(base, specs, compare.parse_workers(args.workers) or [base.cluster.workers],
                                   args.repeats, args.servers, baseline=False)
        except config.ConfigError as e:
            wrong.append(f"{name}: {cmd}: {e}")
    assert len(commands) > 40   # (the commands are found: a changed layout does not pass by matching nothing)
    assert not wrong, "\n".join(wrong)


def output_files() -> str:
    text = open(README).read()
    return text[text.index("## Output files"):text.index("## Reliability")]


def test_readme_says_which_step_line_fields_are_running_totals():
    """A step line's samples, step and bytes are the process's totals so far (a script that
    summed `samples` over the lines got about steps/2 times the job's), the others the
    step's own: README said neither."""
    from psgd.metrics import LOGGED_STATS
    section = " ".join(output_files().split())
    said = re.search(r"\(([^()]*) are running totals counted from the process's start", section)
    assert said, "README's Output files does not say which step-line fields are running totals"
    assert set(re.findall(r"`([a-z_]+)`", said.group(1))) == set(LOGGED_STATS.values())


def test_readme_says_what_the_summary_rates_are_of():
    """summary.json's time, rates and fractions: of what, and in which unit (README named them only)."""
    section = " ".join(output_files().split())
    for field in ("wall_s", "samples", "samples_per_s", "max_clock_gap", "wait_fraction", "bytes_per_sample"):
        assert re.search(rf"`{field}` \(", section), f"README's Output files does not say what {field} is"


ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
SOURCES = [*glob.glob(os.path.join(ROOT, "psgd", "**", "*.py"), recursive=True),
           *glob.glob(os.path.join(ROOT, "servers", "*.py")), *glob.glob(os.path.join(ROOT, "workers", "*.py"))]


def code_names() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, list[str]]]:
    """From the sources, without importing them: class -> the names it has (methods,
    class attributes, `self.x = ...`, and `__base__Name` per base class), module (file
    stem) -> its top-level names, and a method name -> the classes that define it."""
    import ast
    classes: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    methods: dict[str, list[str]] = {}
    for path in SOURCES:
        tree = ast.parse(open(path).read())
        top = modules.setdefault(os.path.splitext(os.path.basename(path))[0], set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                top.update(t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                           if isinstance(t, ast.Name))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            have = classes.setdefault(cls.name, set())
            have.update(f"__base__{b.id}" for b in cls.bases if isinstance(b, ast.Name))
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef):
                    have.add(node.name)
                    methods.setdefault(node.name, []).append(cls.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    have.add(node.attr)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    have.update(t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                                if isinstance(t, ast.Name))
    return classes, modules, methods


def test_architecture_names_what_the_code_has():
    """docs/architecture.md names the functions that do each part: every `Class.name`
    (a class of psgd's, or one it inherits), `module.name` (psgd's modules by file name),
    path (psgd/x.py), and bare class name it cites exists, and a private name is cited
    with its class (`Shard._serve_checked`, not `_serve_read`: unqualified, it cannot be
    checked, and a renamed or rerouted step went unnoticed)."""
    classes, modules, _ = code_names()

    def has(cls: str, name: str) -> bool:
        got = classes.get(cls, set())
        return name in got or any(has(b[8:], name) for b in got if b.startswith("__base__"))

    text = open(ARCHITECTURE).read()
    wrong = []
    for path in set(re.findall(r"\b((?:psgd|servers|workers)/[\w/]*\.py)\b", text)):
        if not os.path.exists(os.path.join(ROOT, path)):
            wrong.append(f"{path}: no such file")
    for owner, name in set(re.findall(r"(?<![\w./`-])`?([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b", text)):
        if name in ("py", "md", "jsonl", "json", "toml", "pt", "log"):
            continue   # a file
        if owner in classes:
            ok = has(owner, name)
        elif owner in modules:
            ok = name in modules[owner]
        elif owner[0].isupper():
            ok = False
        else:
            continue   # an instance (`schedule.step`), a file (`worker-0.jsonl`), a config key
        if not ok:
            wrong.append(f"{owner}.{name}")
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.fullmatch(r"_\w+", span):
            wrong.append(f"{span}: a private name without its class")
        elif re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", span) and span not in classes:
            wrong.append(f"{span}: no such class")
    assert sorted(wrong) == [], "docs/architecture.md names what the code does not have"


def test_architecture_ops_table_is_wire_ops():
    """docs/architecture.md's table of ops has one row per op of `wire.OPS`, and says
    who serves it as the code does: the coordinator's ops are those its serve loop
    dispatches; a shard's those `Shard.handlers` has, and where a row names modes, the
    modes whose rule serves the op (`ServerRule.serves`)."""
    from psgd import wire
    from psgd.consistency import MODES
    from psgd.shard import Shard
    text = open(ARCHITECTURE).read()
    start = text.index("| op | sent by | served by |")
    rows = text[start:].split("\n\n")[0].splitlines()[2:]
    served: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        for op in re.findall(r"`([a-z_]+)`", cells[0]):
            served[op] = cells[2]
    assert sorted(served) == sorted(wire.OPS), "the table's ops are not wire.OPS"
    source = open(os.path.join(ROOT, "servers", "coordinator.py")).read()
    coordinator = set(re.findall(r'"(\w+)": self\.on_\w+', source))
    shard = set(Shard(config.load(None, []), 0).handlers)
    wrong = []
    for op, who in served.items():
        if op in ("reply", "error"):
            continue
        if (who == "coordinator") != (op in coordinator) or who.startswith("shard") != (op in shard):
            wrong.append(f"{op}: the table says {who!r}")
        if who.startswith("shard:"):
            named = {m.strip() for m in who.split(":", 1)[1].split(",")}
            serving = {m for m in MODES if op in MODES[m].rule.serves}
            if named != serving:
                wrong.append(f"{op}: the table names modes {sorted(named)}, the rules serve it in {sorted(serving)}")
    assert wrong == []


def test_readme_layout_names_every_module():
    """README's Layout names every module of psgd/, psgd/sim/, servers/ and workers/ (a
    module added without a word there went unlisted: forkserver.py, baseline.py, ...)."""
    import fnmatch
    text = open(README).read()
    start = text.index("## Layout")
    block = text[text.index("```", start) + 3:]
    block = block[:block.index("```")]
    named = set(re.findall(r"[\w*]+\.py", block))
    missing = []
    for folder in ("psgd", "servers", "workers"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "*.py"))):
            name = os.path.basename(path)
            if name not in ("__init__.py", "__main__.py") and not any(fnmatch.fnmatch(name, n) for n in named):
                missing.append(f"{folder}/{name}")
    sim = block[block.index("sim/ ("):]
    sim = sim[:sim.index(")")]
    for path in sorted(glob.glob(os.path.join(ROOT, "psgd", "sim", "*.py"))):
        stem = os.path.basename(path)[:-3]
        if stem != "__init__" and not re.search(rf"\b{stem}\b", sim):
            missing.append(f"psgd/sim/{stem}.py")
    assert missing == [], "README's Layout does not name these modules"


def test_readme_idea_table_has_every_mode():
    """README's "The idea" has one row per mode of the registry."""
    from psgd.consistency import NAMES
    text = open(README).read()
    start = text.index("## The idea")
    table = text[text.index("| mode |", start):]
    table = table[:table.index("\n\n")]
    assert [re.match(r"\| `(\w+)`", r).group(1) for r in table.splitlines()[2:]] == list(NAMES)


def test_every_torch_install_the_docs_show_pins_the_tested_torch():
    """README's GPU install was `pip install torch --index-url .../whl/cu124`: unpinned, it
    took that index's newest torch (cu124 has none after 2.6), which psgd's `torch>=2.1`
    then kept, in place of the 2.13.0 that the CPU install, the images and the tests use.
    Every `pip install torch` of README and docs/*.md pins the Dockerfile's TORCH_VERSION,
    and a CUDA index is the one deploy/compose.gpu.yaml builds with."""
    dockerfile = open(os.path.join(ROOT, "deploy", "docker", "Dockerfile")).read()
    version = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1)
    gpu = open(os.path.join(ROOT, "deploy", "compose.gpu.yaml")).read()
    cuda = re.search(r"DEPLOY_CUDA_TORCH_INDEX_URL:-(\S+?)\}", gpu).group(1)
    installs = []
    for path in [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        for line in open(path):
            found = re.findall(r"pip install [^`\n#]*?\btorch\b[^`\n#]*", line)
            installs += [(os.path.basename(path), command) for command in found]
    assert installs
    for where, command in installs:
        assert f"torch=={version}" in command.split(), (where, command)
        index = re.search(r"--index-url (\S+)", command)
        assert index is None or "/whl/cu" not in index.group(1) or index.group(1) == cuda, (where, command)
