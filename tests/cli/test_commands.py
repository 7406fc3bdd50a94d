"""The `moe-lm` command: every job is a sub-command, every option has help text and one meaning across commands,
presets resolve from the package wherever it runs, --print-config prints the resolved config, and the launch/
scripts are thin entry points to the same commands."""

from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path

import pytest
import yaml

from moe_lm.cli import command_parser
from moe_lm.cli.main import COMMANDS, parser
from moe_lm.config import config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    return {
        name: command_parser(importlib.import_module(f"moe_lm.cli.{module}"), prog=f"moe-lm {name}")
        for name, (module, _) in COMMANDS.items()
        if module
    }


def options(ap: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in ap._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def test_the_top_level_help_lists_every_job(process):
    # why a process of its own: this is the one check of the installed `moe-lm` console script's wiring
    out = process.moe_lm("--help")
    assert out.returncode == 0
    for job in ("prepare", "train", "generate", "export", "eval", "analyze", "ablate", "experiment", "bench",
                "estimate", "config"):  # fmt: skip
        assert f"    {job}" in out.stdout, job


def test_every_option_has_help_text_and_shows_its_default():
    for name, ap in command_parsers().items():
        for action in options(ap):
            assert action.help, f"moe-lm {name}: {action.option_strings or action.dest} has no help text"
        text = ap.format_help()
        for action in options(ap):
            if action.default not in (None, False, [], argparse.SUPPRESS) and action.option_strings:
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)


def test_a_flag_means_one_thing_in_every_command():
    """The same flag name takes the same kind of value (metavar, nargs, action) wherever it appears."""
    seen: dict[str, tuple] = {}
    for name, ap in command_parsers().items():
        for action in options(ap):
            for flag in action.option_strings:
                kind = (action.metavar, action.nargs, type(action).__name__)
                if flag in seen:
                    assert seen[flag][1] == kind, f"{flag}: {seen[flag][0]} and moe-lm {name} differ: {kind}"
                else:
                    seen[flag] = (f"moe-lm {name}", kind)


def test_every_command_and_launch_script_answers_help(cli):
    for name in COMMANDS:
        out = cli(name, "--help")
        assert out.returncode == 0 and "usage: moe-lm" in out.stdout, (name, out.stderr[-500:])
    for script in sorted((ROOT / "launch").glob("*.py")):
        out = cli.script(script.name, "--help")
        assert out.returncode == 0 and "usage:" in out.stdout, (script.name, out.stderr[-500:])


def test_a_launch_script_answers_help_in_a_process_of_its_own(process):
    """The one check of a launch/ script's wiring as `python launch/<script>` starts it (the others run in process
    above)."""
    out = process.script("train.py", "--help")
    assert out.returncode == 0 and "usage: train.py" in out.stdout, out.stderr[-500:]


def test_launch_scripts_are_thin_entry_points():
    for script in sorted((ROOT / "launch").glob("*.py")):
        if script.name in ("serve_check.py", "gguf_check.py", "gpu_check.py"):  # they run where moe-lm is not
            continue  # installed: vLLM's and llama.cpp's own venvs, the GPU machine (docs/gpu.md)
        module = ast.parse(script.read_text())
        body = module.body[1:] if ast.get_docstring(module) else module.body  # the code after the docstring
        code = [line for line in ast.unparse(ast.Module(body, [])).splitlines() if line.strip()]
        assert len(code) <= 4, f"{script.name}: {len(code)} lines of code; the work belongs in moe_lm/cli"


def test_presets_resolve_from_the_package_in_any_working_directory(cli, tmp_path):
    out = cli("config", "--config", "tiny_gqa", "model.dim=64", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg == config_to_dict(load_config(ROOT / "configs" / "tiny_gqa.yaml", ["model.dim=64"]))
    bad = cli("train", "--config", "tiniest", cwd=tmp_path)
    assert bad.returncode == 2 and "no preset of that name (presets: deepseek_v3_16b," in bad.stderr
    listed = cli("config", "--list").stdout
    assert "tiny " in listed and "gpu_1b " in listed


def test_print_config_prints_the_resolved_config_and_warns_of_a_warmup_longer_than_the_run(cli, tmp_path):
    out = cli("train", "--config", "tiny", "--out", tmp_path / "run", "train.max_steps=20", "--print-config")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    want = load_config(ROOT / "configs" / "tiny.yaml", ["train.max_steps=20", f"train.out_dir={tmp_path / 'run'}"])
    assert printed == config_to_dict(want)
    assert "# warning: optim.warmup_steps=50 >= train.max_steps=20: the run ends while warming up" in out.stdout
    assert not (tmp_path / "run").exists()  # nothing ran


def test_the_config_reference_is_current():
    from moe_lm.config_docs import reference

    assert (ROOT / "docs" / "config.md").read_text() == reference(), "run: moe-lm config --reference > docs/config.md"


def test_the_reference_lists_every_key():
    from moe_lm.config import Config
    from moe_lm.config_docs import reference

    text = reference()
    flat = pd_flat(config_to_dict(Config()))
    missing = [k for k in flat if f"`{k}`" not in text]
    assert not missing, missing


def pd_flat(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        keys += pd_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return keys


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "moe", "--help"]])
def test_bench_is_a_command(cli, argv):
    out = cli(*argv)
    assert out.returncode == 0 and "moe-lm bench" in out.stdout


def test_parser_declares_only_the_chosen_command():
    ap = parser("generate")
    assert ap.parse_args(["generate", "--run", "runs/x"]).max_new_tokens == 120


def test_every_key_has_a_meaning_in_the_reference():
    from moe_lm.config_docs import reference

    rows = [line for line in reference().splitlines() if line.startswith("| `")]
    empty = [row.split("|")[1].strip() for row in rows if not row.rstrip(" |").split("|")[-1].strip()]
    assert rows and not empty, f"keys without a comment above their field in moe_lm/config/schema.py: {empty}"
