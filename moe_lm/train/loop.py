"""The training loop under DeepSpeed: one optimizer step, and the cadence of logging, evaluation and checkpoints.

One optimizer step = grad_accum_steps micro-batches on every data-parallel rank. Step `s` consumes the global
samples [base + s*G, base + (s+1)*G) with G = cfg.global_batch(world) (micro_batch_size x grad_accum_steps x dp,
dp = world / pp_size), micro-batch m of data-parallel rank r taking its slice; so a run at another layout with the
same G sees identical batches, and resuming continues the sample stream exactly where the checkpoint left it. The
step itself is moe_lm/train/step.py's: with pipeline stages (parallel.pp_size > 1) DeepSpeed's `train_batch`, every
stage of a data-parallel replica reading the same micro-batches, the first its inputs, the last its labels.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lm.checkpoint import save_resume
from moe_lm.checkpoint.format import data_reference, latest_tag
from moe_lm.config import Config, ConfigError, config_warnings, dump_config, require_ep_divides
from moe_lm.console import set_verbose
from moe_lm.data.batches import TrainWindows
from moe_lm.data.prepare import DataReadLock, load_split
from moe_lm.data.shards import unigram_entropy
from moe_lm.deepspeed_layout import describe_stages, stage_parts, stage_slices, stages_without_experts
from moe_lm.errors import RunError
from moe_lm.model import (
    Transformer,
    build_by_layer,
    build_model,
    count_params,
    loss_chunk,
    train_flops_per_token,
    uses_layer_seeds,
)
from moe_lm.model.sdpa_backend import mla_choice
from moe_lm.parallel.deepspeed_setup import (
    build_engine,
    device,
    init_distributed,
    peers,
    use_bf16,
    zero_optimization,
)
from moe_lm.parallel.engine import Engine
from moe_lm.parallel.expert_parallel import apply_expert_parallel, dispatchers
from moe_lm.parallel.pipeline import Pipeline, StepTally, build_pipeline, check_cut
from moe_lm.train.balance import balance_step
from moe_lm.train.evaluate import evaluate
from moe_lm.train.flops import Throughput, peak_flops
from moe_lm.train.init_from import start_from
from moe_lm.train.inputs import check_inputs, eval_sets, prepare_default_corpus
from moe_lm.train.objective import (
    Objective,
    objective_for,
)
from moe_lm.train.recompute import apply_activation_checkpointing, apply_compile, compiles
from moe_lm.train.run_folder import run_folder
from moe_lm.train.schedule import lr_at, mtp_weight_at
from moe_lm.train.step import NextTokenLoss, PipelineObjective, pipeline_step, train_step
from moe_lm.train.stop import StopOnSignal, Stopped, WatchPeers
from moe_lm.train.tracker import Tracker


@dataclass
class _Run:
    """A started run: what each of its steps uses."""

    cfg: Config
    run_dir: Path
    tracker: Tracker
    windows: TrainWindows
    engine: Engine
    model: Transformer
    objective: Objective
    throughput: Throughput
    evaluate: Callable[[int], dict]  # step -> the evaluation's metrics (logged)
    watch: WatchPeers
    rank: int
    world: int
    dp_rank: int  # this rank's place among the ranks of its pipeline stage (= rank without pipeline stages)
    dp_size: int  # the ranks of one stage: world / parallel.pp_size
    pipeline: Pipeline | None  # the stages, with parallel.pp_size > 1
    bad_steps: int = 0  # consecutive skipped steps
    # the optimizer steps' own time, summed since step 0 (not start-up, evaluation or checkpoints): an experiment's
    # loss against measured training time
    train_seconds: float = 0.0
    data_ref: dict | None = None  # the data the run read, as it was at its start (saved with each checkpoint)
    compiled: bool = False  # performance.compile on this device: the first step's time (its compilation) is logged
    steps_here: int = 0  # optimizer steps this process ran

    @property
    def global_batch(self) -> int:
        return self.cfg.global_batch(self.world)


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured; returns the last evaluation's metrics."""
    cfg.validate()  # a config built in code (dataclasses.replace) skipped load_config's checks
    set_verbose(cfg.logging.verbose)
    init_distributed()
    t, run_dir = cfg.train, Path(cfg.train.out_dir)
    tracker = Tracker(cfg, run_dir, enabled=dist.get_rank() == 0)
    for warning in config_warnings(cfg):
        tracker.info(warning)
    cfg, pretrained = start_from(cfg, run_dir, tracker.info) if t.init_from else (cfg, None)
    prepare_default_corpus(cfg, tracker.info)
    data_read = DataReadLock(cfg.data.out_dir)  # held to the end: the data cannot be prepared again under the run
    try:
        data_meta = check_inputs(cfg)
        # what this run reads, recorded once: a checkpoint never claims a tokenizer prepared after the run started
        data_ref = data_reference(cfg)
        windows = TrainWindows(load_split(cfg.data.out_dir, "train"), t.seq_len, cfg.seed)
        evalsets = eval_sets(cfg, tracker.info)
        everyone = peers()  # who is who, to name a rank that dies later
    except BaseException:
        data_read.close()
        raise
    # why WatchPeers innermost: it turns a dead peer's error into PeerLost before StopOnSignal exits, which then
    # keeps its handler so that the launcher's SIGTERM cannot end this rank before it reports
    with (
        data_read,
        run_folder(run_dir, t.resume, tracker.info),
        StopOnSignal() as stop,
        tracker,
        WatchPeers(everyone, run_dir) as watch,
    ):
        restart = save_resume.resume_across_stages(cfg, run_dir, tracker.info) if t.resume else None
        start_model = restart.model if restart else pretrained
        run = _start(cfg, run_dir, tracker, windows, evalsets, start_model, data_meta, watch)
        run.data_ref = data_ref
        if restart:
            state = restart.state
        elif t.resume:
            state = save_resume.resume(run.engine, cfg, run_dir, tracker.info)
        else:
            state = {"step": 0, "samples": 0, "train_seconds": 0.0}
        start_step, sample_base = state["step"], state["samples"]
        run.train_seconds = state.get("train_seconds", math.nan)  # nan: resumed from a checkpoint that lacks it
        watch.done = start_step
        if run.rank == 0:
            dump_config(cfg, run_dir / "config.yaml")
        tracker.start(start_step)
        tracker.info(f"{_header(cfg, run.model, run.world, run.global_batch, data_meta)}; {run.throughput.source}")
        end_step = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
        last_eval = run.evaluate(0) if pretrained is not None and start_step == 0 else {}  # the pretrained model's
        if start_step >= end_step:
            tracker.info(f"{run_dir} is at step {start_step} already (train.max_steps/stop_at end at {end_step})")
        for step in range(start_step, end_step):
            first = sample_base + (step - start_step) * run.global_batch
            last_eval = _step(run, step, first, end_step, stop) or last_eval
    if last_eval and not math.isfinite(last_eval["loss"]):
        good = latest_tag(run_dir) or "none"
        loss = last_eval["loss"]
        raise RunError(f"the final validation loss is {loss}: the run diverged; the last good checkpoint is {good}")
    if last_eval and dist.get_rank() == 0:  # of the split this run read (its memory map), not what is there now
        last_eval["unigram_entropy"] = unigram_entropy(windows.tokens, cfg.model.vocab_size)
    return last_eval


def _start(cfg, run_dir, tracker, windows, evalsets, pretrained, data_meta, watch) -> _Run:
    """Build the model and its engine (`build_trainee`) and what each step uses besides."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    model, pipeline, engine, compiled = build_trainee(cfg, pretrained, tracker.info)
    dp_rank, dp_size = (pipeline.grid.data_parallel_id, world // cfg.parallel.pp_size) if pipeline else (rank, world)
    objective = PipelineObjective(engine, pipeline) if pipeline else objective_for(cfg)
    evaluation = Evaluation(engine=engine, model=model, evalsets=evalsets, cfg=cfg, device=dev,
                            doc_start_id=data_meta["bos_id"], tracker=tracker, objective=objective,
                            data_parallel=(dp_rank, dp_size))  # fmt: skip
    return _Run(
        cfg=cfg, run_dir=run_dir, tracker=tracker, windows=windows, engine=engine, model=model, objective=objective,
        throughput=run_throughput(cfg, world, dev, tracker.info), evaluate=evaluation, watch=watch, rank=rank,
        world=world, dp_rank=dp_rank, dp_size=dp_size, pipeline=pipeline, compiled=compiled,
    )  # fmt: skip


def build_trainee(
    cfg: Config, pretrained: Transformer | None, info
) -> tuple[Transformer, Pipeline | None, Engine, bool]:
    """The model (every rank the same, from the seed or the pretrained weights) with expert parallelism,
    recomputation and compilation applied, cut into stages with parallel.pp_size > 1, in DeepSpeed's engine; and
    whether it compiles. `moe-lm bench loop` builds its loop arm with it."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    t, pp = cfg.train, cfg.parallel.pp_size
    require_ep_divides(cfg.parallel.ep_size, cfg.model.moe.n_routed_experts, world, pp)  # before any stage is cut
    if pp > 1 and (dense := stages_without_experts(cfg, world)):
        raise ConfigError(
            f"parallel.pp_size={pp}: pipeline stage{'s' if len(dense) > 1 else ''} {', '.join(map(str, dense))} would "
            f"hold no routed experts (the cut gives {describe_stages(cfg, stage_slices(cfg, 0, world)[0])}; "
            f"model.first_k_dense_replace={cfg.model.first_k_dense_replace}), and DeepSpeed's optimizer would wait "
            "forever at the first step; use fewer stages, more layers, or fewer leading dense layers"
        )
    torch.manual_seed(cfg.seed)
    if pretrained is not None:
        model = pretrained
    elif uses_layer_seeds(cfg):  # a stage builds its own layers only (the others stay on the meta device)
        model = build_by_layer(cfg.model, cfg.seed, stage_parts(cfg, rank, world) if pp > 1 else None)
    else:
        model = build_model(cfg.model)
    model = apply_expert_parallel(model, cfg.parallel.ep_size, pp)  # every rank: the same model
    model = apply_activation_checkpointing(model, cfg.performance.activation_checkpointing)
    compiled = compiles(cfg.performance.compile, dev)
    model = apply_compile(model, compiled)
    if cfg.model.attention == "mla":  # which fused kernel runs attention here, and whether v is padded for it
        qk, v = cfg.model.mla.qk_nope_head_dim + cfg.model.mla.qk_rope_head_dim, cfg.model.mla.v_head_dim
        dtype = torch.bfloat16 if use_bf16(cfg.parallel, dev) else torch.float32
        info(f"attention: {mla_choice(dev.type, dtype, qk, v).describe(qk, v)}")
    schedule = cfg.parallel.pp_schedule
    pipeline = None
    if pp > 1:
        tally = StepTally(depth=len(model.mtp), aux_scale=1.0 / t.grad_accum_steps)
        pipeline = build_pipeline(model, pp, tally, NextTokenLoss(model, tally, loss_chunk(cfg)), schedule)
    if pipeline:
        check_cut(pipeline, cfg)
        info(f"pipeline ({schedule}): {describe_stages(cfg, pipeline.module.parts)} (cut by parameters)")
    engine = build_engine(pipeline.module if pipeline else model, optim=cfg.optim, train=t, parallel=cfg.parallel)
    return model, pipeline, engine, compiled


def run_throughput(cfg: Config, world: int, dev: torch.device, info) -> Throughput:
    """Tokens/s and MFU of one optimizer step of the global batch, against `world` devices' peak."""
    t = cfg.train
    tokens = cfg.global_batch(world) * t.seq_len
    peak, peak_source = peak_flops(dev, cfg.logging.peak_tflops)
    flops_per_step = train_flops_per_token(cfg.model, t.seq_len, cfg.objective.prefix_len) * tokens
    return Throughput(flops_per_step, tokens, peak * world, info, f"MFU against {peak_source}")


def _step(run: _Run, step: int, first: int, end_step: int, stop: StopOnSignal) -> dict | None:
    """Optimizer step `step` on the global batch that starts at sample `first`, then what is due after it: the
    train row, an evaluation (returned), a checkpoint, a stop on a signal."""
    cfg, c, t0 = run.cfg, run.cfg.cadence, time.perf_counter()
    lr = lr_at(step, cfg.optim, cfg.train.max_steps)
    mtp_weight = mtp_weight_at(step, cfg.model.mtp, cfg.train.max_steps)
    batches = _micro_batches(run, first)
    if run.pipeline:
        losses, applied = pipeline_step(run.engine, run.pipeline, batches, lr, mtp_weight)
    else:
        losses, applied = train_step(run.engine, run.model, batches, lr, mtp_weight, run.objective)
    run.watch.done = step_done = step + 1
    logged = step_done % c.log_interval == 0 or step_done == end_step
    # the row's routing numbers on logged steps only: they wait for the device (and cost a little) on every step
    balance, counts = balance_step(run.model, cfg.model.moe.bias_update_speed, apply=applied, metrics=logged)
    dt = time.perf_counter() - t0
    run.train_seconds += dt
    run.steps_here += 1
    if run.compiled and run.steps_here == 1:
        run.tracker.info(f"torch.compile: the first step took {dt:.1f} s with the compilation "
                         "(performance.compile=false runs eagerly)")  # fmt: skip
    _count_bad_step(run, applied, losses["loss"], step_done)
    if logged:
        row = {"step": step_done, **losses, "lr": lr, "skipped": not applied}
        if cfg.model.mtp.depth:
            row["mtp_weight"] = mtp_weight
        row = {**row, **run.throughput(dt), "samples": first + run.global_batch, "train_seconds": run.train_seconds}
        row.update(balance)
        _log_train(run.tracker, run.engine, run.model, row, counts)
    result = run.evaluate(step_done) if step_done % c.eval_interval == 0 or step_done == end_step else None
    signum = stop.requested(device())
    due = c.ckpt_interval > 0 and (step_done % c.ckpt_interval == 0 or step_done == end_step)
    if due or signum:
        state = {"step": step_done, "samples": first + run.global_batch, "global_batch": run.global_batch}
        state["train_seconds"] = run.train_seconds
        if not _save(run, state) and step_done == end_step:
            good = latest_tag(run.run_dir) or "none (no checkpoint was written)"
            raise RunError(f"the run ended with an unhealthy model; the last good checkpoint is {good}")
    if signum:
        name = signal.Signals(signum).name
        raise Stopped(signum, f"stopped by {name} after step {step_done}; the same command resumes the run")
    return result


def _count_bad_step(run: _Run, applied: bool, loss: float, step_done: int) -> None:
    """A skipped step (non-finite loss or gradient) is reported; max_bad_steps of them in a row end the run."""
    run.bad_steps = 0 if applied else run.bad_steps + 1
    if applied:
        return
    run.tracker.info(f"warning: step {step_done}: non-finite loss or gradient (loss {loss}); update skipped")
    if run.bad_steps >= run.cfg.train.max_bad_steps:
        raise RunError(
            f"{run.bad_steps} consecutive steps had a non-finite loss (last at step {step_done}); stopping. "
            f"Lower optim.lr, raise optim.warmup_steps, or check the data; the last good checkpoint is "
            f"{latest_tag(run.run_dir) or 'none (no checkpoint was written)'} in {run.run_dir / 'checkpoints'}"
        )


def _micro_batches(run: _Run, first: int):
    """This rank's micro-batches of the global batch that starts at sample `first`."""
    t, dev = run.cfg.train, device()
    for m in range(t.grad_accum_steps):
        start = first + (m * run.dp_size + run.dp_rank) * t.micro_batch_size
        yield to_device(run.windows.batch(start, t.micro_batch_size), dev)


def to_device(batch: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """`batch` on `dev`. why pinned on CUDA: a copy from pageable memory waits for every kernel queued before it
    (the previous micro-batch's backward), so the GPU would start each micro-batch with an empty queue."""
    if dev.type != "cuda":
        return batch.to(dev)
    return batch.pin_memory().to(dev, non_blocking=True)


@dataclass(frozen=True)
class Evaluation:
    """The evaluation a run does every cadence.eval_interval steps: `evaluation(step)` evaluates, logs the row and
    its console line, and returns the metrics."""

    engine: Engine
    model: Transformer
    evalsets: dict
    cfg: Config
    device: torch.device
    doc_start_id: int
    tracker: Tracker
    objective: Objective
    data_parallel: tuple[int, int]  # (this rank's place among its stage's ranks, their number)

    def __call__(self, step: int) -> dict:
        cfg = self.cfg
        result = evaluate(
            self.engine, self.model, self.evalsets, cfg.train.micro_batch_size, self.device, self.doc_start_id,
            self.objective, cfg.cadence.eval_score_from, self.data_parallel,
        )  # fmt: skip
        self.tracker.log({"kind": "eval", "step": step, **result})
        self.tracker.console(_eval_line(result), step)
        return result


def _log_train(tracker: Tracker, engine: Engine, model: Transformer, row: dict, counts: list[torch.Tensor]) -> None:
    grad_norm = engine.get_global_grad_norm()
    row = {"kind": "train", **row, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}
    if dispatchers(model):
        row["a2a_bytes_per_rank"] = sum(d.stats["bytes_sent"] for d in dispatchers(model))
        row["a2a_inter_node_bytes_per_rank"] = sum(d.stats["bytes_inter"] for d in dispatchers(model))
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


def _save(run: _Run, state: dict) -> bool:
    """Save unless the model is unhealthy (a streak of skipped steps, or non-finite weights): a bad model never
    becomes `latest`, and no good checkpoint is pruned for it. Returns whether it saved."""
    why = "the last step was skipped (non-finite loss or gradient)" if run.bad_steps else None
    if why is None and not save_resume.weights_finite(run.model):
        why = "the weights are not finite"
    if why:
        run.tracker.info(
            f"warning: not saving step {state['step']}: {why}; the last good checkpoint is "
            f"{latest_tag(run.run_dir) or 'none'}"
        )
        return False
    cfg = run.cfg
    tag = save_resume.save(run.engine, run.run_dir, state["step"], cfg, state, cfg.cadence.keep_last, run.data_ref,
                           run.tracker.info)  # fmt: skip
    run.tracker.info(f"saved checkpoint {run.run_dir / 'checkpoints' / tag}")
    return True


def _header(cfg: Config, model: Transformer, world: int, G: int, data_meta: dict) -> str:
    n = count_params(cfg.model)
    mtp = f" + {cfg.model.mtp.depth} MTP module(s) of {n.mtp_total / 1e6:.2f}M" if cfg.model.mtp.depth else ""
    return (
        f"moe-lm: {n.total / 1e6:.2f}M parameters ({n.active / 1e6:.2f}M active per token){mtp}, "
        f"{len(model.moe_layers())} MoE layers x {cfg.model.moe.n_routed_experts} experts (top-"
        f"{cfg.model.moe.num_experts_per_tok}), world {world}{_stages(cfg.parallel.pp_size, world)}, "
        f"ZeRO-{zero_optimization(cfg.parallel, world)['stage']}, "
        f"global batch {G} x {cfg.train.seq_len} tokens; data {cfg.data.out_dir}: "
        f"{data_meta['tokens']['train']:,} train tokens in {len(data_meta['domains'])} domains"
    )


def _stages(pp: int, world: int) -> str:
    return f" (pipeline {pp} stages x {world // pp} data-parallel)" if pp > 1 else ""


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
