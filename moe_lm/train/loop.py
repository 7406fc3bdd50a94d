"""The training loop under DeepSpeed: one optimizer step, and the cadence of logging, evaluation and checkpoints.

One optimizer step = grad_accum_steps micro-batches on every rank. Step `s` consumes the global samples
[base + s*G, base + (s+1)*G) with G = micro_batch_size * grad_accum_steps * world, micro-batch m of rank r taking
its slice; so a run at another world size with the same G sees identical batches, and resuming continues the
sample stream exactly where the checkpoint left it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lm.checkpoint import save_resume
from moe_lm.checkpoint.format import latest_tag
from moe_lm.config import Config, ConfigError, config_to_dict, dump_config
from moe_lm.data.batches import TrainWindows, eval_windows
from moe_lm.data.documents import DataError
from moe_lm.data.prepare import build_signature, load_split, prepare_data, read_meta, signature_changes
from moe_lm.errors import RunError
from moe_lm.model import Transformer, build_model, count_params
from moe_lm.parallel.deepspeed_setup import build_engine, device, init_distributed, peers
from moe_lm.parallel.expert_parallel import apply_expert_parallel, dispatchers
from moe_lm.train.balance import balance_step
from moe_lm.train.evaluate import evaluate
from moe_lm.train.flops import Throughput, peak_flops, train_flops_per_token
from moe_lm.train.objective import NEXT_TOKEN, Objective, next_token_losses, total_loss
from moe_lm.train.recompute import apply_activation_checkpointing, apply_compile
from moe_lm.train.run_folder import run_folder
from moe_lm.train.schedule import lr_at, mtp_weight_at
from moe_lm.train.stop import StopOnSignal, Stopped, WatchPeers
from moe_lm.train.tracker import Tracker


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured; returns the last evaluation's metrics."""
    cfg.validate()  # a config built in code (dataclasses.replace) skipped load_config's checks
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev, t, run_dir = device(), cfg.train, Path(cfg.train.out_dir)
    tracker = Tracker(cfg, run_dir, enabled=rank == 0)
    cfg, pretrained = _start_from(cfg, run_dir, tracker) if t.init_from else (cfg, None)
    _prepare_default_corpus(cfg, tracker)
    data_meta = _check_inputs(cfg)
    windows = TrainWindows(load_split(cfg.data.out_dir, "train"), t.seq_len, cfg.seed)
    evalsets = _evalsets(cfg, tracker)
    G = t.micro_batch_size * t.grad_accum_steps * world
    objective = Objective.of(cfg)
    everyone = peers()  # who is who, to name a rank that dies later
    # why WatchPeers innermost: it turns a dead peer's error into PeerLost before StopOnSignal exits, which then
    # keeps its handler so that the launcher's SIGTERM cannot end this rank before it reports
    with (
        run_folder(run_dir, t.resume, tracker.info),
        StopOnSignal() as stop,
        tracker,
        WatchPeers(everyone, run_dir) as watch,
    ):
        torch.manual_seed(cfg.seed)
        model = pretrained or build_model(cfg.model)
        model = apply_expert_parallel(model, cfg.parallel.ep_size)  # every rank: the same model
        model = apply_activation_checkpointing(model, t.activation_checkpointing)
        model = apply_compile(model, t.compile)
        engine = build_engine(model, cfg)
        start_step, sample_base = save_resume.resume(engine, cfg, run_dir, tracker.info) if t.resume else (0, 0)
        watch.done = start_step
        if rank == 0:
            dump_config(cfg, run_dir / "config.yaml")
        tracker.start(start_step)
        peak, peak_source = peak_flops(dev, cfg.logging.peak_tflops)
        flops_per_step = train_flops_per_token(cfg.model, t.seq_len, t.prefix_len) * G * t.seq_len
        throughput = Throughput(flops_per_step, G * t.seq_len, peak * world, tracker.info)
        tracker.info(f"{_header(cfg, model, world, G, data_meta)}; MFU against {peak_source}")
        last_eval, bad_steps = {}, 0
        end_step = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
        evaluate_at = functools.partial(_evaluate, engine, model, evalsets, cfg, dev, data_meta["bos_id"], tracker)
        if pretrained is not None and start_step == 0:
            last_eval = evaluate_at(0)  # the pretrained model's own loss, before any update
        if start_step >= end_step:
            tracker.info(f"{run_dir} is at step {start_step} already (train.max_steps/stop_at end at {end_step})")
        for step in range(start_step, end_step):
            t0 = time.perf_counter()
            first = sample_base + (step - start_step) * G
            lr = lr_at(step, cfg.optim, t.max_steps)
            mtp_weight = mtp_weight_at(step, cfg.model.mtp, t.max_steps)
            batches = _micro_batches(windows, first, t, rank, world, dev)
            losses, applied = train_step(engine, model, batches, lr, mtp_weight, objective)
            watch.done = step + 1
            balance, counts = balance_step(model, cfg.model.moe.bias_update_speed, apply=applied)
            step_done, dt = step + 1, time.perf_counter() - t0
            bad_steps = 0 if applied else bad_steps + 1
            if not applied:
                loss = losses["loss"]
                tracker.info(f"warning: step {step_done}: non-finite loss or gradient (loss {loss}); update skipped")
                if bad_steps >= t.max_bad_steps:
                    raise RunError(
                        f"{bad_steps} consecutive steps had a non-finite loss (last at step {step_done}); stopping. "
                        f"Lower optim.lr, raise optim.warmup_steps, or check the data; the last good checkpoint is "
                        f"{latest_tag(run_dir) or 'none (no checkpoint was written)'} in {run_dir / 'checkpoints'}"
                    )
            if step_done % t.log_interval == 0 or step_done == end_step:
                row = {"step": step_done, **losses, "lr": lr, "skipped": not applied}
                if cfg.model.mtp.depth:
                    row["mtp_weight"] = mtp_weight
                _log_train(tracker, engine, model, {**row, **throughput(dt), "samples": first + G, **balance}, counts)
            if step_done % t.eval_interval == 0 or step_done == end_step:
                last_eval = evaluate_at(step_done)
            signum = stop.requested(dev)
            due = t.ckpt_interval > 0 and (step_done % t.ckpt_interval == 0 or step_done == end_step)
            if due or signum:
                state = {"step": step_done, "samples": first + G, "global_batch": G}
                if not _save(engine, model, run_dir, cfg, state, bad_steps == 0, tracker) and step_done == end_step:
                    good = latest_tag(run_dir) or "none (no checkpoint was written)"
                    raise RunError(f"the run ended with an unhealthy model; the last good checkpoint is {good}")
            if signum:
                name = signal.Signals(signum).name
                raise Stopped(signum, f"stopped by {name} after step {step_done}; the same command resumes the run")
    if last_eval and not math.isfinite(last_eval["loss"]):
        good = latest_tag(run_dir) or "none"
        loss = last_eval["loss"]
        raise RunError(f"the final validation loss is {loss}: the run diverged; the last good checkpoint is {good}")
    return last_eval


def train_step(
    engine, model: Transformer, micro_batches, lr: float, mtp_weight: float = 0.0, objective: Objective = NEXT_TOKEN
) -> tuple[dict, bool]:
    """One optimizer step over this rank's micro-batches [micro, seq_len + 1]. Returns the losses averaged over all
    micro-batches and ranks ({"loss": the main head's CE, "aux_loss", "mtp_loss/depth_k" per MTP depth}) and
    whether the update was applied (DeepSpeed skips it when the gradient norm is not finite, which a NaN/inf loss
    makes it)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    engine.train()
    for d in dispatchers(model):
        d.reset_stats()
    depth = len(model.mtp)
    sums = torch.zeros(3 + depth, device=next(model.parameters()).device)  # ce, aux, mtp depths, micro-batches
    for batch in micro_batches:
        out, labels = objective.run(engine, batch, mtp=depth > 0, logits=not objective.loss_chunk)
        ce, mtp = next_token_losses(out, labels, model.lm_head.weight, objective.loss_chunk)
        engine.backward(total_loss(ce, mtp, mtp_weight, out.aux_loss))
        engine.step()
        sums += torch.stack([ce.detach(), out.aux_loss.detach().float(), *(m.detach() for m in mtp), sums.new_ones(())])
    dist.all_reduce(sums)
    means = (sums[:-1] / sums[-1]).tolist()
    losses = {"loss": means[0], "aux_loss": means[1]}
    losses.update({f"mtp_loss/depth_{k}": v for k, v in enumerate(means[2:], start=1)})
    return losses, engine.was_step_applied() and math.isfinite(means[0])


def _micro_batches(windows: TrainWindows, first: int, t, rank: int, world: int, dev):
    """This rank's micro-batches of the global batch that starts at sample `first`."""
    for m in range(t.grad_accum_steps):
        yield windows.batch(first + (m * world + rank) * t.micro_batch_size, t.micro_batch_size).to(dev)


def _evaluate(engine, model, evalsets, cfg: Config, dev, doc_start_id: int, tracker: Tracker, step: int) -> dict:
    result = evaluate(engine, model, evalsets, cfg.train.micro_batch_size, dev, doc_start_id, Objective.of(cfg))
    tracker.log({"kind": "eval", "step": step, **result})
    tracker.console(_eval_line(result), step)
    return result


def _log_train(tracker: Tracker, engine, model: Transformer, row: dict, counts: list[torch.Tensor]) -> None:
    grad_norm = engine.get_global_grad_norm()
    row = {"kind": "train", **row, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}
    if dispatchers(model):
        row["a2a_bytes_per_rank"] = sum(d.stats["bytes_sent"] for d in dispatchers(model))
    dev = next(model.parameters()).device
    if dev.type == "cuda":  # the high-water mark of this rank's allocator since the start
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    tracker.log(row, {f"expert_load/layer_{i}": c.numpy() for i, c in zip(model.moe_layer_ids(), counts, strict=True)})
    maxvio = max((v for k, v in row.items() if k.startswith("maxvio/")), default=0.0)
    tracker.console(
        f"step {row['step']}/{tracker.max_steps} | loss {row['loss']:.4f}{_mtp_part(row)} | lr {row['lr']:.2e} | gnorm "
        f"{row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.1f}% | max MaxVio "
        f"{maxvio:.3f}",
        row["step"],
    )


def _start_from(cfg: Config, run_dir: Path, tracker: Tracker) -> tuple[Config, Transformer | None]:
    """train.init_from=hf:PATH: the checkpoint's architecture replaces cfg.model (the MoE section's training
    settings and the MTP section stay the config's), and its weights are the model, unless the run resumes from its
    own checkpoint. MTP modules the checkpoint holds are loaded up to model.mtp.depth; deeper ones start afresh."""
    from moe_lm.interop.hf import from_hf_config, import_hf

    path = cfg.train.init_from.removeprefix("hf:")
    try:
        import transformers

        model_cfg = from_hf_config(transformers.AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.init_from={cfg.train.init_from}: cannot load it ({e})") from None
    keep = ("experts_impl", "bias_update_speed", "seq_aux_alpha", "aux_alpha")
    model_cfg = dataclasses.replace(
        model_cfg,
        moe=dataclasses.replace(model_cfg.moe, **{k: getattr(cfg.model.moe, k) for k in keep}),
        mtp=cfg.model.mtp,
    )
    changed = [k for k, v in config_to_dict(model_cfg).items() if config_to_dict(cfg.model)[k] != v]
    tracker.info(f"train.init_from: model.* from {path}/config.json ({', '.join(changed) or 'nothing'} changed)")
    cfg = dataclasses.replace(cfg, model=model_cfg)
    if cfg.train.resume and latest_tag(run_dir) is not None:
        tracker.info(f"train.init_from: its weights are not loaded, {run_dir} resumes from its own checkpoint")
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
        tracker.info(
            f"train.init_from: {len(pretrained.mtp)} MTP module(s) in the checkpoint, {loaded} loaded, "
            f"{model_cfg.mtp.depth - loaded} initialised afresh (model.mtp.depth={model_cfg.mtp.depth})"
        )
    return cfg, model


def _prepare_default_corpus(cfg: Config, tracker: Tracker) -> None:
    """The embedded corpus takes seconds to prepare: on a fresh clone rank 0 prepares it, the other ranks wait."""
    if cfg.data.sources != ["default"] or (Path(cfg.data.out_dir) / "meta.json").is_file():
        return
    if dist.get_rank() == 0:
        tracker.info(f"no prepared data in {cfg.data.out_dir}: preparing the embedded default corpus (once)")
        prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed, log=tracker.info)
    dist.barrier()


def _check_inputs(cfg: Config) -> dict:
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
            "prepare it again (python launch/prepare_data.py --config <config> --force) or point data.out_dir "
            "at the data prepared for this config"
        )
    return meta


def _evalsets(cfg: Config, tracker: Tracker) -> dict[str, torch.Tensor]:
    t = cfg.train
    shard = load_split(cfg.data.out_dir, "val")
    evalsets = eval_windows(shard, t.seq_len, t.eval_batches * t.micro_batch_size)
    if not evalsets:
        raise DataError(f"the validation split of {cfg.data.out_dir} holds no text; raise data.val_fraction")
    missing = [d for d in shard.domains if d not in evalsets]
    if missing:
        tracker.info(f"warning: no validation text in domain(s) {', '.join(missing)}: left out of evaluation")
    return evalsets


def _save(engine, model: Transformer, run_dir: Path, cfg: Config, state: dict, healthy: bool, tracker) -> bool:
    """Save unless the model is unhealthy (a streak of skipped steps, or non-finite weights): a bad model never
    becomes `latest`, and no good checkpoint is pruned for it. Returns whether it saved."""
    why = "the last step was skipped (non-finite loss or gradient)" if not healthy else None
    if why is None and not save_resume.weights_finite(model):
        why = "the weights are not finite"
    if why:
        tracker.info(
            f"warning: not saving step {state['step']}: {why}; the last good checkpoint is "
            f"{latest_tag(run_dir) or 'none'}"
        )
        return False
    tag = save_resume.save(engine, run_dir, state["step"], cfg, state, cfg.train.keep_last)
    tracker.info(f"saved checkpoint {run_dir / 'checkpoints' / tag}")
    return True


def _header(cfg: Config, model: Transformer, world: int, G: int, data_meta: dict) -> str:
    n = count_params(cfg.model)
    mtp = f" + {cfg.model.mtp.depth} MTP module(s) of {n.mtp_total / 1e6:.2f}M" if cfg.model.mtp.depth else ""
    return (
        f"moe-lm: {n.total / 1e6:.2f}M parameters ({n.active / 1e6:.2f}M active per token){mtp}, "
        f"{len(model.moe_layers())} MoE layers x {cfg.model.moe.n_routed_experts} experts (top-"
        f"{cfg.model.moe.num_experts_per_tok}), world {world}, ZeRO-{cfg.parallel.zero_stage}, "
        f"global batch {G} x {cfg.train.seq_len} tokens; data {cfg.data.out_dir}: "
        f"{data_meta['tokens']['train']:,} train tokens in {len(data_meta['domains'])} domains"
    )


def _eval_line(ev: dict) -> str:
    domains = " ".join(f"{k[5:]}={v:.3f}" for k, v in ev.items() if k.startswith("loss/"))

    def worst(prefix: str) -> float:
        return max((v for k, v in ev.items() if k.startswith(prefix)), default=0.0)

    return (
        f"eval loss {ev['loss']:.4f} (ppl {ev['ppl']:.1f}){_mtp_part(ev)} | {domains} | max MaxVio_global "
        f"{worst('maxvio_global/'):.3f} | max domain JSD {worst('domain_jsd/'):.3f} bits"
    )


def _mtp_part(row: dict) -> str:
    """' | mtp1 4.1234 | mtp2 ...' for the MTP depths' losses in a logged row ('' without MTP)."""
    prefix = "mtp_loss/depth_"
    return "".join(f" | mtp{k[len(prefix) :]} {v:.4f}" for k, v in row.items() if k.startswith(prefix))
