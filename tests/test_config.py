"""Config loading: YAML + dotted overrides into typed dataclasses, strict errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_lm.config import Config, ConfigError, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def test_presets_load_and_validate():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config)


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
    ],
)
def test_cross_field_rules(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, overrides)


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
