"""One typed config tree: a YAML preset plus dotted overrides, loaded once and handed out in sections.

    cfg = load_config("configs/tiny.yaml", ["optim.lr=3e-4", "model.moe.n_routed_experts=16"])
    model = Transformer(cfg.model)          # each component receives its own section only

Unknown keys and values of the wrong type are errors that name the dotted path. Values are coerced by the
field's declared type, because YAML reads `1e-3` as a string. `validate()` checks cross-field rules.

The package: schema.py (the sections, their documented fields and rules: docs/config.md is generated from it),
loading.py (presets, `base:` chains, overrides, dump), decode.py (mapping -> dataclasses), choices.py (the names
research variants register), moved_keys.py (renamed keys, and their end). Everything is importable from here.
"""

from moe_lm.config.choices import VARIANTS_MODULE, choices, register_choice
from moe_lm.config.decode import from_dict
from moe_lm.config.loading import (
    PRESETS,
    config_to_dict,
    dump_config,
    load_config,
    preset_path,
    presets,
    read_preset,
    safe_yaml,
    yaml_problem,
)
from moe_lm.config.moved_keys import MOVED, MOVED_UNTIL
from moe_lm.config.schema import (
    CadenceConfig,
    Config,
    DataConfig,
    GQAConfig,
    LoggingConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    PerformanceConfig,
    RopeScalingConfig,
    TrainConfig,
    config_warnings,
    require_ep_divides,
)
from moe_lm.errors import ConfigError

__all__ = [
    "MOVED", "MOVED_UNTIL", "PRESETS", "VARIANTS_MODULE", "CadenceConfig", "Config", "ConfigError", "DataConfig",
    "GQAConfig", "LoggingConfig", "MLAConfig", "MTPConfig", "ModelConfig", "MoEConfig", "ObjectiveConfig",
    "OptimConfig", "ParallelConfig", "PerformanceConfig", "RopeScalingConfig", "TrainConfig", "choices",
    "config_to_dict", "config_warnings", "dump_config", "from_dict", "load_config", "preset_path", "presets",
    "read_preset", "register_choice", "require_ep_divides", "safe_yaml", "yaml_problem",
]  # fmt: skip
