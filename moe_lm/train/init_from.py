"""A new run that starts from pretrained weights (train.init_from=hf:PATH): a transformers DeepseekV3 / Glm4Moe
checkpoint's architecture and weights, through the importer of moe_lm/interop/hf.py."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

from moe_lm.checkpoint.format import latest_tag
from moe_lm.config import Config, ConfigError, config_to_dict
from moe_lm.interop.hf import from_hf_config, hf_config, import_hf
from moe_lm.model import Transformer


def start_from(cfg: Config, run_dir: Path, log) -> tuple[Config, Transformer | None]:
    """train.init_from=hf:PATH: the checkpoint's architecture replaces cfg.model (the MoE section's training
    settings and the MTP section stay the config's), and its weights are the model, unless the run resumes from its
    own checkpoint. MTP modules the checkpoint holds are loaded up to model.mtp.depth; deeper ones start afresh."""
    path = cfg.train.init_from.removeprefix("hf:")
    try:
        model_cfg = from_hf_config(hf_config(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.init_from={cfg.train.init_from}: cannot load it ({e})") from None
    keep = ("experts_impl", "bias_update_speed", "seq_aux_alpha", "aux_alpha")
    model_cfg = dataclasses.replace(
        model_cfg,
        moe=dataclasses.replace(model_cfg.moe, **{k: getattr(cfg.model.moe, k) for k in keep}),
        mtp=cfg.model.mtp,
    )
    changed = [k for k, v in config_to_dict(model_cfg).items() if config_to_dict(cfg.model)[k] != v]
    log(f"train.init_from: model.* from {path}/config.json ({', '.join(changed) or 'nothing'} changed)")
    cfg = dataclasses.replace(cfg, model=model_cfg)
    if cfg.train.resume and latest_tag(run_dir) is not None:
        log(f"train.init_from: its weights are not loaded, {run_dir} resumes from its own checkpoint")
        return cfg, None
    model = Transformer(model_cfg)
    try:
        pretrained = import_hf(path)
    except pickle.UnpicklingError:  # transformers reads .bin weights weights-only: nothing in them ran
        raise ConfigError(
            f"train.init_from={cfg.train.init_from}: its weights file holds objects a weights-only load refuses; "
            "nothing in it ran. Use a checkpoint in safetensors (save_pretrained writes them)"
        ) from None
    ours = model.state_dict()
    model.load_state_dict({k: v for k, v in pretrained.state_dict().items() if k in ours}, strict=False)
    if model_cfg.mtp.depth or len(pretrained.mtp):
        loaded = min(len(pretrained.mtp), model_cfg.mtp.depth)
        log(
            f"train.init_from: {len(pretrained.mtp)} MTP module(s) in the checkpoint, {loaded} loaded, "
            f"{model_cfg.mtp.depth - loaded} initialised afresh (model.mtp.depth={model_cfg.mtp.depth})"
        )
    return cfg, model
