"""Where the user meets the scripts: bad arguments and bad files end in one line on stderr with exit code 2 and no
traceback, before anything slow runs; a prompt longer than the context is cut, not a crash."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from moe_lm.inference.generate import fit_prompt


def refused(proc, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error", "usage", "generate.py"))]
    assert lines and all(n in proc.stderr for n in needles), proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.parametrize("script", ["export_hf.py", "analyze_routing.py", "ablate_experts.py"])
def test_an_unusable_out_is_refused_before_the_model_is_loaded(cli, script, tmp_path):
    (tmp_path / "a_file").write_text("mine")
    # the run does not exist: a message about --out shows --out was checked first
    refused(cli.script(script, "--run", tmp_path / "no_run", "--out", tmp_path / "a_file"), "--out", "not a folder")
    assert (tmp_path / "a_file").read_text() == "mine"


def test_export_refuses_overrides_it_would_ignore(cli, tmp_path):
    refused(cli.script("export_hf.py", "--run", tmp_path, "--out", tmp_path / "x", "model.dim=256"), "--config only")


@pytest.mark.parametrize(
    "flags, message",
    [(["--temperature", "-1"], "--temperature must be >= 0"), (["--temperature", "nan"], "--temperature must be"),
     (["--top-k", "-1"], "--top-k must be >= 0"), (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1")],
)  # fmt: skip
def test_generate_refuses_meaningless_sampling_settings(cli, flags, message):
    refused(cli.script("generate.py", "--run", "runs/none", *flags), message)


def test_fit_prompt_keeps_the_start_token_and_the_newest_tokens():
    ids = list(range(100, 110))
    assert fit_prompt(ids, max_seq_len=16, max_tokens=4) == (ids, 0)
    assert fit_prompt(ids, max_seq_len=10, max_tokens=4) == ([100, 105, 106, 107, 108, 109], 4)
    assert fit_prompt(ids, max_seq_len=5, max_tokens=4) == ([100], 9)


def test_a_prompt_longer_than_the_context_is_cut_with_a_warning(cli, trained_run):
    run = trained_run(max_steps=2)
    proc = cli.script("generate.py", "--run", run, "--prompt", "stir the onions " * 200, "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: the prompt has" in proc.stderr and "model.max_seq_len=" in proc.stderr
    refused(cli.script("generate.py", "--run", run, "--max-new-tokens", "5000"), "leaves no room for a prompt")


def test_a_damaged_or_missing_tokenizer_is_named(cli, copied_run, tmp_path):
    from moe_lm.config import load_config
    from moe_lm.data.tokenizer import load_data_tokenizer
    from moe_lm.errors import DataError

    copy = Path(copied_run(max_steps=2).train.out_dir)
    original, data = Path(load_config(copy / "config.yaml").data.out_dir), tmp_path / "data"
    shutil.copytree(original, data)
    for ref in copy.glob("checkpoints/step_*/data_ref.json"):  # the copied run reads the copied data
        ref.write_text(ref.read_text().replace(str(original.resolve()), str(data.resolve())))
    (data / "tokenizer.model").write_bytes(b"\x00garbage")
    # the run's checkpoint knows its tokenizer's hash: the damaged file is caught before it is parsed
    refused(
        cli.script("generate.py", "--run", copy, "--prompt", "the"), str(data), "tokenizer.model", "edited or damaged"
    )
    with pytest.raises(DataError, match=f"{data / 'tokenizer.model'} is not a readable sentencepiece model.*prepare"):
        load_data_tokenizer(data)
    (data / "tokenizer.model").unlink()
    with pytest.raises(DataError, match=f"no tokenizer in {data}.*moe-lm prepare"):
        load_data_tokenizer(data)


USER_ERRORS = [
    ("prepare_data.py", "--config", "nowhere.yaml"),
    ("train.py", "--config", "nowhere.yaml"),
    ("estimate_memory.py", "--config", "nowhere.yaml"),
    ("experiment.py", "no_such_experiment"),
    ("generate.py", "--run", "no_such_run"),
    ("bench_decode.py", "--run", "no_such_run"),
    ("export_hf.py", "--run", "no_such_run", "--out", "{tmp}/out"),
    ("analyze_routing.py", "--run", "no_such_run", "--out", "{tmp}/out"),
    ("ablate_experts.py", "--run", "no_such_run", "--out", "{tmp}/out"),
]


@pytest.mark.parametrize("command", USER_ERRORS, ids=[e[0] for e in USER_ERRORS])
def test_every_script_ends_a_user_error_in_one_line_with_exit_code_2(cli, command, tmp_path):
    script, args = command[0], [a.format(tmp=tmp_path) for a in command[1:]]
    proc = cli.script(script, *args)
    refused(proc, "no_such" if "no_such" in " ".join(args) else "nowhere")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr[-2000:]
    debug = cli.script(script, *args, "--debug")  # the traceback is there when asked for
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_bug_inside_a_command_shows_its_traceback_not_a_user_error(cli, trained_run, tmp_path, monkeypatch):
    import moe_lm.interop.hf as hf

    def planted(*args, **kwargs):
        return {}["a key the code forgot"]  # a programming error, as a bug would raise it

    monkeypatch.setattr(hf, "export_run", planted)
    proc = cli("export", "--run", trained_run(), "--out", tmp_path / "export")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and "KeyError: 'a key the code forgot'" in proc.stderr
    assert "error: a key the code forgot" not in proc.stderr
    assert not (tmp_path / "export").exists()  # the output folder is still written whole or not at all


ALIAS_BOMB = "".join(
    [f"l0: &l0 [{', '.join(['x'] * 10)}]\n"]
    + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9)]
    + ["model:\n  dim: *l8\n"]
)


def test_a_yaml_alias_bomb_in_a_checkpoints_config_is_refused_in_one_short_line(cli, copied_run, tmp_path):
    copied_run()
    for config in (tmp_path / "run").rglob("config.yaml"):
        config.write_text(ALIAS_BOMB)
    proc = cli("export", "--run", tmp_path / "run", "--out", tmp_path / "export")
    refused(proc, "aliases (*name) are not accepted")
    assert len(proc.stderr) < 1000 and not (tmp_path / "export").exists()


def test_long_values_in_config_errors_are_cut(tmp_path):
    from moe_lm.config import ConfigError, load_config

    (tmp_path / "c.yaml").write_text("train:\n  max_steps: [" + ", ".join(["123456789"] * 100000) + "]\n")
    with pytest.raises(ConfigError, match="expected an integer") as err:
        load_config(tmp_path / "c.yaml")
    assert len(str(err.value)) < 300


def test_a_checkpoint_whose_config_was_edited_to_another_architecture_is_one_line(cli, copied_run, tmp_path):
    import yaml

    copied_run()
    ckpt = max((tmp_path / "run" / "checkpoints").glob("step_*"))
    for edit in ({"n_layers": 3}, {"dim": 48}, {"attention": "gqa"}):
        config = yaml.safe_load((ckpt / "config.yaml").read_text())
        config["model"].update(edit)
        (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
        proc = cli("generate", "--run", tmp_path / "run", "--prompt", "the", "--max-new-tokens", "2")
        refused(proc, "config.yaml does not describe the weights saved beside it")
        shutil.copyfile(tmp_path / "run" / "config.yaml", ckpt / "config.yaml")  # restored: it generates again
        assert cli("generate", "--run", tmp_path / "run", "--max-new-tokens", "2").returncode == 0


@pytest.mark.parametrize("flag", ["--prompt", "--chart-tokens"])
def test_bytes_that_are_not_utf8_in_text_flags_are_refused(cli, trained_run, tmp_path, flag):
    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of a Latin-1 byte in argv
    command = ["generate", "--run", trained_run()] if flag == "--prompt" else ["analyze", "--run", trained_run(),
                                                                               "--out", tmp_path / "a"]  # fmt: skip
    refused(cli(*command, flag, latin1), flag, "not UTF-8")


@pytest.mark.parametrize(
    "argv, said",
    [(["bench", "moe", "--device", "gpu"], "'gpu' is not a torch device"),
     (["bench", "train", "--device", "cuda:7"], "cuda"),
     (["analyze", "--run", "runs/none", "--out", "x", "--device", "cuda"], "cuda"),
     (["eval", "--run", "runs/none", "--out", "x", "--tasks", "t", "--device", "tpu"], "'tpu' is not a torch device")],
)  # fmt: skip
def test_a_device_this_machine_lacks_is_one_line(cli, argv, said):
    """`moe-lm bench ... --device cuda` on a machine without CUDA (or an unknown device) ended in a traceback from
    deep inside torch; the flag is checked first."""
    if argv[-1].startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refused(cli(*argv), "--device", said)
