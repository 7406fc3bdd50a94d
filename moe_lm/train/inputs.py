"""The data a run trains and evaluates on, prepared when it is the embedded default and checked against the config
before anything is built."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from moe_lm.config import Config
from moe_lm.data.batches import eval_windows
from moe_lm.data.prepare import build_signature, load_split, prepare_data, read_meta, signature_changes
from moe_lm.errors import DataError


def prepare_default_corpus(cfg: Config, log) -> None:
    """The embedded corpus takes seconds to prepare: on a fresh clone rank 0 prepares it, the other ranks wait."""
    if cfg.data.sources != ["default"] or (Path(cfg.data.out_dir) / "meta.json").is_file():
        return
    if dist.get_rank() == 0:
        log(f"no prepared data in {cfg.data.out_dir}: preparing the embedded default corpus (once)")
        prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed, log=log)
    dist.barrier()


def check_inputs(cfg: Config) -> dict:
    """What can be checked before anything is built: that the prepared data is the one the config names (sources,
    their files, settings, vocabulary). Returns meta.json."""
    meta = read_meta(cfg.data.out_dir)
    trained_here = cfg.data.tokenizer == "train"  # then the vocabulary is model.vocab_size pieces exactly
    if meta["vocab_size"] > cfg.model.vocab_size or (trained_here and meta["vocab_size"] != cfg.model.vocab_size):
        raise DataError(
            f"{cfg.data.out_dir} was tokenized with {meta['vocab_size']} pieces but model.vocab_size="
            f"{cfg.model.vocab_size}: set model.vocab_size={meta['vocab_size']}"
            + (", or prepare the data again with this config" if trained_here else " (or larger)")
        )
    # why not the seed: it only seeded the tokenizer's training; another training seed on the same data is fine
    changed = signature_changes(meta["signature"], build_signature(cfg.data, cfg.model.vocab_size, 0), ("seed",))
    if changed:
        raise DataError(
            f"{cfg.data.out_dir} was not prepared from what data.* names now ({', '.join(changed)} differ): "
            "prepare it again (moe-lm prepare --config <config> --force) or point data.out_dir "
            "at the data prepared for this config"
        )
    return meta


def eval_sets(cfg: Config, log) -> dict[str, torch.Tensor]:
    """The fixed validation windows of each domain that every evaluation of the run scores."""
    shard = load_split(cfg.data.out_dir, "val")
    evalsets = eval_windows(shard, cfg.train.seq_len, cfg.cadence.eval_batches * cfg.train.micro_batch_size)
    if not evalsets:
        raise DataError(f"the validation split of {cfg.data.out_dir} holds no text; raise data.val_fraction")
    missing = [d for d in shard.domains if d not in evalsets]
    if missing:
        log(f"warning: no validation text in domain(s) {', '.join(missing)}: left out of evaluation")
    return evalsets
