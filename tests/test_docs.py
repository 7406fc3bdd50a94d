"""The documentation cannot rot: every command shown in README.md, docs/*.md and tests/README.md names a command,
script or make target that exists, with flags that command takes and config keys that exist (an old spelling is
refused too); every relative link points at a file; every Python block compiles. The README's quick tour runs in
test_quick_tour.py, exactly as printed."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import re
import shlex
import typing
from pathlib import Path

import pytest

from moe_lm.cli import command_parser
from moe_lm.cli.main import COMMANDS
from moe_lm.config import MOVED, Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL = ("", "bash", "sh", "shell", "console")
LAUNCH = {  # launch/ script -> the command it is
    "train.py": "train", "prepare_data.py": "prepare", "generate.py": "generate", "export_hf.py": "export",
    "evaluate.py": "eval", "analyze_routing.py": "analyze", "ablate_experts.py": "ablate",
    "experiment.py": "experiment", "estimate_memory.py": "estimate",
}  # fmt: skip


def blocks(path: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in languages]


def command_lines(block: str) -> list[list[str]]:
    """Each command of a shell block as argv (continuations joined, comments and env assignments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:
            continue  # an output line quoting half a string
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def config_keys() -> set[str]:
    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            yield from walk(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{f.name}"]

    return set(walk(Config, ""))


KEYS = config_keys()


def check_overrides(values: list[str], where: str) -> None:
    for item in values:
        key = item.partition("=")[0]
        assert key not in MOVED, f"{where}: {key} is now {MOVED[key]}"
        assert key in KEYS, f"{where}: no config key {key!r}"


def parse(command: str, args: list[str], where: str) -> None:
    module, _ = COMMANDS[command]
    if module is None:  # bench: its own sub-commands
        from moe_lm.cli.bench import parser

        ap = parser(args[0] if args else None)
    else:
        ap = command_parser(importlib.import_module(f"moe_lm.cli.{module}"), prog=f"moe-lm {command}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = ap.parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"{where}: moe-lm {command} {shlex.join(args)}: {err.getvalue().strip()}") from e
    check_overrides(getattr(ns, "overrides", None) or [], where)


def check(argv: list[str], where: str) -> None:
    head, rest = Path(argv[0]).name, argv[1:]
    if head == "moe-lm":
        assert rest and rest[0] in COMMANDS, f"{where}: no command in {shlex.join(argv)}"
        if "--help" not in rest:
            parse(rest[0], rest[1:], where)
    elif head == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert rest[0] in targets, f"{where}: make {rest[0]}: no such target"
    elif head in ("python", "python3", "deepspeed"):
        check_script(head, rest, where)


def check_script(head: str, rest: list[str], where: str) -> None:
    """python launch/X.py ..., python -m moe_lm.bench ..., deepspeed [its flags] launch/X.py ..."""
    if rest[:2] == ["-m", "moe_lm.bench"]:
        return parse("bench", rest[2:], where)
    scripts = [i for i, a in enumerate(rest) if a.endswith(".py")]
    if not scripts:
        return
    i = scripts[0]
    path = ROOT / rest[i]
    assert path.is_file() or not rest[i].startswith("launch/"), f"{where}: {rest[i]} does not exist"
    if path.name in LAUNCH and "--help" not in rest:
        parse(LAUNCH[path.name], rest[i + 1 :], where)


SHELL_COMMANDS = [
    pytest.param(argv, f"{path.relative_to(ROOT)}", id=f"{path.name}:{shlex.join(argv)[:60]}")
    for path in DOCS
    for block in blocks(path, SHELL)
    for argv in command_lines(block)
    if Path(argv[0]).name in ("moe-lm", "make", "python", "python3", "deepspeed")
]


@pytest.mark.parametrize("argv, where", SHELL_COMMANDS)
def test_every_documented_command_parses(argv, where):
    check(argv, where)


def test_the_docs_show_commands_at_all():
    assert len(SHELL_COMMANDS) > 40


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_point_at_files_and_python_blocks_compile(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not target.startswith(("http://", "https://", "mailto:")):
            assert (path.parent / target).exists(), f"{path.name}: link to {target}, which does not exist"
    for i, code in enumerate(blocks(path, ("python",))):
        compile(code, f"{path.name} python block {i}", "exec")


def test_config_keys_in_prose_exist():
    """Dotted config keys in backticks in the docs exist; an old spelling is refused. (`model.` followed by no
    model field is a transformers tensor or file name, not a config key; docs/config.md lists the old spellings.)"""
    sections = {k.split(".")[0] for k in KEYS}
    model_fields = {k.split(".")[1] for k in KEYS if k.startswith("model.")}
    for path in DOCS:
        if path.name == "config.md":
            continue
        for key in re.findall(r"`([a-z]+\.[\w.]+)", path.read_text()):
            key = key.rstrip(".")
            section, first = key.split(".")[:2]
            if section not in sections or (section == "model" and first not in model_fields):
                continue
            known = key in KEYS or any(k.startswith(key + ".") for k in KEYS)
            assert known, f"{path.name}: `{key}` is no config key" + (f" (now {MOVED[key]})" if key in MOVED else "")
