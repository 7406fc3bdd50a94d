"""Config loading: YAML + dotted overrides into typed dataclasses, strict errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

import moe_lm.experiments.variants  # noqa: F401  (registers the research variants used below)
from moe_lm.config import Config, ConfigError, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def test_presets_load_and_validate():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config)


def test_each_preset_writes_its_own_run_folder():
    out_dirs = [load_config(path).train.out_dir for path in sorted((ROOT / "configs").glob("*.yaml"))]
    assert len(out_dirs) == len(set(out_dirs)), out_dirs


def test_a_preset_builds_on_its_base_section_by_section(tmp_path):
    (tmp_path / "child.yaml").write_text(f"base: {TINY}\nmodel:\n  attention: gqa\ntrain:\n  out_dir: runs/child\n")
    child, tiny = load_config(tmp_path / "child.yaml"), load_config(TINY)
    assert child.model.attention == "gqa" and child.train.out_dir == "runs/child"
    # everything else is the base's, including the rest of the sections the child touched
    assert child.model.moe == tiny.model.moe and child.train.max_steps == tiny.train.max_steps
    assert child.optim == tiny.optim and child.data == tiny.data


def test_base_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "c.yaml")


def test_yaml_syntax_and_encoding_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: 64\n  moe: [1, 2\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML, line \d+, column \d+"):
        load_config(bad)
    bad.write_bytes("model:\n  dim: 64 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"bad\.yaml: not UTF-8"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"override 'train.max_steps=\[1': the value is not valid YAML"):
        load_config(TINY, ["train.max_steps=[1"])


def test_yaml_scientific_notation_is_a_float():
    # PyYAML reads `1e-3` (no dot) as a string; the field type must win.
    cfg = load_config(TINY)
    assert cfg.model.moe.bias_update_speed == pytest.approx(1e-2)
    assert cfg.optim.lr == pytest.approx(3e-3) and isinstance(cfg.optim.lr, float)


def test_overrides_are_coerced_by_field_type():
    cfg = load_config(
        TINY,
        [
            "model.moe.n_routed_experts=16",
            "model.moe.seq_aux_alpha=3e-4",
            "model.moe.norm_topk_prob=false",
            "model.attention=gqa",
            "model.dim=256",
        ],
    )
    assert cfg.model.moe.n_routed_experts == 16
    assert cfg.model.moe.seq_aux_alpha == pytest.approx(3e-4)
    assert cfg.model.moe.norm_topk_prob is False
    assert cfg.model.attention == "gqa" and cfg.model.dim == 256


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.moe.n_routed_expert=8", "model.moe.n_routed_expert"),  # typo
        ("model.dim=abc", "model.dim"),
        ("model.dim=1.5", "model.dim"),
        ("model.attention=flash", "model.attention"),
        ("model.moe.norm_topk_prob=maybe", "model.moe.norm_topk_prob"),
        ("modell.dim=3", "modell"),
    ],
)
def test_bad_keys_and_types_name_the_dotted_path(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, [override])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.moe.n_group=3"], "model.moe.n_group"),  # 8 experts are not divisible into 3 groups
        (["model.moe.topk_group=5"], "model.moe.topk_group"),  # more kept groups than groups
        (["model.moe.topk_group=1", "model.moe.num_experts_per_tok=3"], "model.moe.num_experts_per_tok"),
        (["model.first_k_dense_replace=9"], "model.first_k_dense_replace"),
        (["model.attention=gqa", "model.gqa.n_kv_heads=3"], "model.gqa.n_kv_heads"),
        (["model.mla.qk_rope_head_dim=7"], "model.mla.qk_rope_head_dim"),
        (["performance.loss_chunk=-1"], "performance.loss_chunk"),
    ],
)
def test_cross_field_rules(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, overrides)


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_outside_numpys_range_is_refused_naming_the_key(seed):
    with pytest.raises(ConfigError, match=rf"^seed = {seed} is out of range: give an integer from 0 to 4294967295$"):
        load_config(TINY, [f"seed={seed}"])
    assert load_config(TINY, [f"seed={2**32 - 1}"]).seed == 2**32 - 1


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(TINY, ["model.dim"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(ROOT / "configs" / "nope.yaml")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(TINY, ["model.dim.x=1"])


def test_dump_round_trips(tmp_path):
    cfg = load_config(TINY, ["model.moe.n_routed_experts=16", "model.moe.aux_alpha=1e-2"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_keys_moved_out_of_train_still_load_with_a_one_line_note(tmp_path, capsys, monkeypatch):
    """Configs and run folders written before train was split into train/cadence/objective/performance load
    unchanged; each old spelling is noted once, and giving both spellings is refused."""
    from moe_lm.config import moved_keys

    monkeypatch.setattr(moved_keys, "_noted", set())
    old = tmp_path / "old.yaml"
    old.write_text("train: {max_steps: 5, log_interval: 7, objective: lm, loss_chunk: 16}\n")
    cfg = load_config(old, ["train.eval_interval=9", "train.compile=true"])
    assert (cfg.train.max_steps, cfg.cadence.log_interval, cfg.cadence.eval_interval) == (5, 7, 9)
    assert (cfg.objective.name, cfg.performance.loss_chunk, cfg.performance.compile) == ("lm", 16, True)
    notes = capsys.readouterr().err.splitlines()
    assert f"note: train.log_interval is now cadence.log_interval ({old}; the old key still works: rename it)" in notes
    assert len(notes) == 5  # one line per moved key
    load_config(old)
    assert capsys.readouterr().err == ""  # once per process
    both = tmp_path / "both.yaml"
    both.write_text("train: {log_interval: 7}\ncadence: {log_interval: 8}\n")
    with pytest.raises(ConfigError, match="both train.log_interval and cadence.log_interval are set"):
        load_config(both)


def test_research_variant_names_are_refused_until_registered(process):
    """The core knows only its own architecture, mask and objective; the error says how variants register."""
    # why a fresh interpreter: importing moe_lm.experiments.variants (as any command does) registers the variants for
    # the rest of the process, and this one may have imported it already
    code = (
        "from moe_lm.config import load_config, ConfigError\n"
        f"try:\n    load_config({str(TINY)!r}, ['model.attn_mask=prefix'])\n"
        "except ConfigError as e:\n    print(e)\n"
    )
    out = process.python(code).stdout  # from the repository root
    assert "model.attn_mask = 'prefix' is not known; known: causal" in out and "moe_lm.experiments.variants" in out


def test_moved_keys_end_at_their_release_with_the_new_spelling(tmp_path, monkeypatch):
    from moe_lm.config import MOVED_UNTIL, moved_keys

    assert moved_keys.release() < MOVED_UNTIL  # this release: they still load (the test above)
    old = tmp_path / "old.yaml"
    old.write_text("train: {max_steps: 5, log_interval: 7}\n")
    monkeypatch.setattr(moved_keys, "release", lambda: MOVED_UNTIL)
    with pytest.raises(ConfigError, match=r"train.log_interval was renamed cadence.log_interval, .*write cadence"):
        load_config(old)
    with pytest.raises(ConfigError, match="train.compile was renamed performance.compile"):
        load_config(None, ["train.compile=true"])
