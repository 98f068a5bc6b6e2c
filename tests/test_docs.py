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
