"""The training loop under DeepSpeed: batches, loss, bias update, evaluation, logging, checkpoints, resume.

One optimizer step = grad_accum_steps micro-batches on every rank. Step `s` consumes the global samples
[base + s*G, base + (s+1)*G) with G = micro_batch_size * grad_accum_steps * world, micro-batch m of rank r taking
its slice; so a run at another world size with the same G sees identical batches, and resuming continues the
sample stream exactly where the checkpoint left it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lm.analysis.metrics import max_vio, mean_pairwise, pairwise_jsd
from moe_lm.analysis.trace import RoutingRecorder
from moe_lm.config import Config, config_to_dict, dump_config, load_config
from moe_lm.data.batches import TrainWindows, eval_windows
from moe_lm.data.documents import DataError
from moe_lm.data.prepare import load_split
from moe_lm.data.tokenizer import BOS_ID
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import build_engine, device, init_distributed
from moe_lm.parallel.expert_parallel import apply_expert_parallel, dispatchers
from moe_lm.train import checkpoint
from moe_lm.train.balance import balance_step
from moe_lm.train.flops import peak_flops, train_flops_per_token
from moe_lm.train.schedule import lr_at
from moe_lm.train.tracker import Tracker

# Sections whose change makes an existing checkpoint a different experiment (the rest may change on resume).
RESUME_MUST_MATCH = ("model", "data")


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured; returns the last evaluation's metrics."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    t, run_dir = cfg.train, Path(cfg.train.out_dir)
    data_meta = _data_meta(cfg)

    tag = _resume_tag(cfg, run_dir, rank)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    model = apply_expert_parallel(Transformer(cfg.model), cfg.parallel.ep_size)  # every rank builds the same model
    engine = build_engine(model, cfg)
    start_step, sample_base = 0, 0
    if tag is not None:
        saved_ep = load_config(run_dir / "checkpoints" / tag / "config.yaml").parallel.ep_size
        if saved_ep != cfg.parallel.ep_size and rank == 0:
            print(
                f"warning: {tag} was saved at parallel.ep_size={saved_ep}; loading its weights at "
                f"ep_size={cfg.parallel.ep_size} with a fresh optimizer state (DeepSpeed cannot re-shard it)"
            )
        state = checkpoint.load(engine, run_dir, tag, load_optimizer_states=saved_ep == cfg.parallel.ep_size)
        start_step, sample_base = state["step"], state["samples"]
        if rank == 0:
            print(f"resumed from {run_dir / 'checkpoints' / tag} at step {start_step}", flush=True)
    tracker = Tracker(cfg, run_dir, start_step, enabled=rank == 0)

    windows = TrainWindows(load_split(cfg.data.out_dir, "train"), t.seq_len, cfg.seed)
    evalsets = eval_windows(load_split(cfg.data.out_dir, "val"), t.seq_len, t.eval_batches * t.micro_batch_size)
    G = t.micro_batch_size * t.grad_accum_steps * world
    flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
    peak = peak_flops(dev, cfg.logging.peak_tflops) * world
    if rank == 0:
        _print_header(cfg, model, world, G, data_meta)

    last_eval: dict = {}
    bad_steps = 0
    end_step = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.optim, t.max_steps)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        engine.train()
        for d in dispatchers(model):
            d.reset_stats()
        ce_sum = torch.zeros((), device=dev)
        aux_sum = torch.zeros((), device=dev)
        first = sample_base + (step - start_step) * G
        for m in range(t.grad_accum_steps):
            begin = first + (m * world + rank) * t.micro_batch_size
            batch = windows.batch(begin, t.micro_batch_size).to(dev)
            out = engine(batch[:, :-1])
            ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
            engine.backward(ce + out.aux_loss)
            engine.step()
            ce_sum += ce.detach().float()
            aux_sum += out.aux_loss.detach().float()
        stats = torch.stack([ce_sum, aux_sum]) / t.grad_accum_steps
        dist.all_reduce(stats)
        loss, aux = (stats / world).tolist()
        # DeepSpeed skips the update when the gradient norm is not finite (a NaN/inf loss makes it so).
        applied = engine.was_step_applied() and math.isfinite(loss)
        balance, counts = balance_step(model, cfg.model.moe.bias_update_speed, apply=applied)
        step_done = step + 1
        if not applied:
            bad_steps += 1
            if rank == 0:
                print(f"warning: step {step_done}: non-finite loss ({loss}); the update was skipped", flush=True)
            if bad_steps >= t.max_bad_steps:
                raise RuntimeError(
                    f"{bad_steps} consecutive steps had a non-finite loss (last at step {step_done}); stopping. "
                    f"Lower optim.lr, raise optim.warmup_steps, or check the data; the last good checkpoint is "
                    f"in {run_dir / 'checkpoints'}"
                )
        else:
            bad_steps = 0
        dt = time.perf_counter() - t0
        tokens_per_s = G * t.seq_len / dt
        mfu = flops_per_token * tokens_per_s / peak if peak > 0 else 0.0

        if step_done % t.log_interval == 0 or step_done == end_step:
            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            row = {
                "kind": "train",
                "step": step_done,
                "loss": loss,
                "aux_loss": aux,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "skipped": not applied,
                "samples": first + G,
                **balance,
            }
            if cfg.parallel.ep_size > 1:
                row["a2a_bytes_per_rank"] = sum(d.stats["bytes_sent"] for d in dispatchers(model))
            hist = {f"expert_load/layer_{i}": c.numpy() for i, c in zip(model.moe_layer_ids(), counts, strict=True)}
            tracker.log(row, hist)
            maxvio = max((v for k, v in balance.items() if k.startswith("maxvio/")), default=0.0)
            tracker.console(
                f"step {step_done}/{t.max_steps} | loss {loss:.4f} | lr {lr:.2e} | gnorm {grad_norm:.3f} | "
                f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | max MaxVio {maxvio:.3f}",
                step_done,
            )
        if step_done % t.eval_interval == 0 or step_done == end_step:
            last_eval = evaluate(engine, model, evalsets, t.micro_batch_size, dev)
            tracker.log({"kind": "eval", "step": step_done, **last_eval})
            tracker.console(_eval_line(last_eval), step_done)
        if step_done % t.ckpt_interval == 0 or step_done == end_step:
            state = {"step": step_done, "samples": first + G, "global_batch": G}
            tag = checkpoint.save(engine, run_dir, step_done, cfg, state, t.keep_last)
            if rank == 0:
                print(f"saved checkpoint {run_dir / 'checkpoints' / tag}", flush=True)

    tracker.finish()
    return last_eval


@torch.no_grad()
def evaluate(engine, model: Transformer, evalsets: dict[str, torch.Tensor], micro: int, dev) -> dict[str, float]:
    """Per-domain and overall loss/perplexity over the fixed eval windows, and the headline routing metrics per MoE
    layer from what the routers chose there: MaxVio_global, mean pairwise domain JSD (bits), and the share of
    adjacent tokens (same document) with the same first choice / overlapping top-k."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.eval()
    layers = model.moe_layer_ids()
    E = model.cfg.moe.n_routed_experts
    counts = torch.zeros(len(layers), len(evalsets), E, dtype=torch.float64)  # [layer, domain, expert]
    pairs = torch.zeros(len(layers), 3, dtype=torch.float64)  # [layer, (pairs, same first, overlap)]
    sums = torch.zeros(len(evalsets), 2, dtype=torch.float64)  # [domain, (loss sum, tokens)]
    with RoutingRecorder(model) as recorder:
        for d, windows in enumerate(evalsets.values()):
            # every rank runs the same number of forward passes (expert parallelism needs all ranks in each one)
            mine = windows[rank::world][: len(windows) // world] if len(windows) >= world else windows[:0]
            for chunk in mine.split(micro):
                chunk = chunk.to(dev)
                inputs = chunk[:, :-1]
                logits = engine(inputs).logits.float()
                ce = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
                sums[d, 0] += ce.item()
                sums[d, 1] += chunk[:, 1:].numel()
                B, S = inputs.shape
                same_doc = (inputs[:, 1:] != BOS_ID).cpu()  # a BOS starts a new document: no pair across it
                for i, layer in enumerate(layers):
                    idx = recorder.last[layer][0].view(B, S, -1).cpu()
                    counts[i, d] += torch.bincount(idx.flatten(), minlength=E)
                    a, b = idx[:, :-1], idx[:, 1:]
                    overlap = (a[..., :, None] == b[..., None, :]).any(-1).any(-1)
                    pairs[i] += torch.stack(
                        [same_doc.sum(), (same_doc & (a[..., 0] == b[..., 0])).sum(), (same_doc & overlap).sum()]
                    ).double()
    for t in (sums, counts, pairs):
        dist.all_reduce(t)
    result = {}
    for (domain, _), (loss_sum, n) in zip(evalsets.items(), sums.tolist(), strict=True):
        if n > 0:
            result[f"loss/{domain}"] = loss_sum / n
            result[f"ppl/{domain}"] = math.exp(loss_sum / n)
    total = sums.sum(0).tolist()
    result["loss"] = total[0] / max(total[1], 1)
    result["ppl"] = math.exp(result["loss"])
    for i, layer in enumerate(layers):
        result[f"maxvio_global/layer_{layer}"] = max_vio(counts[i].sum(0).numpy())
        share = counts[i] / counts[i].sum(1, keepdim=True).clamp_min(1)
        result[f"domain_jsd/layer_{layer}"] = mean_pairwise(pairwise_jsd(share.numpy()))
        n_pairs = max(pairs[i, 0].item(), 1)
        result[f"same_first/layer_{layer}"] = pairs[i, 1].item() / n_pairs
        result[f"topk_overlap/layer_{layer}"] = pairs[i, 2].item() / n_pairs
    engine.train()
    return result


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the corpus' token frequencies: the loss of the best context-free predictor."""
    p = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def _data_meta(cfg: Config) -> dict:
    meta_path = Path(cfg.data.out_dir) / "meta.json"
    if not meta_path.is_file():
        raise DataError(
            f"no prepared data in {cfg.data.out_dir}: run `python launch/prepare_data.py --config <config>` first"
        )
    meta = json.loads(meta_path.read_text())
    if meta["vocab_size"] != cfg.model.vocab_size:
        raise DataError(
            f"{cfg.data.out_dir} was tokenized with {meta['vocab_size']} pieces but model.vocab_size="
            f"{cfg.model.vocab_size}: prepare the data again with this config, or set model.vocab_size"
        )
    return meta


def _resume_tag(cfg: Config, run_dir: Path, rank: int) -> str | None:
    """The checkpoint to resume from, after checking it belongs to the same experiment."""
    has_run = (run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file()
    if not cfg.train.resume:
        if has_run and rank == 0:
            aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(run_dir), str(aside))
            print(f"train.resume=false: moved the previous run to {aside}", flush=True)
        dist.barrier()
        return None
    tag = checkpoint.latest_tag(run_dir)
    if tag is None:
        return None
    saved = config_to_dict(load_config(run_dir / "checkpoints" / tag / "config.yaml"))
    now = config_to_dict(cfg)
    changed = [s for s in RESUME_MUST_MATCH if saved[s] != now[s]]
    if changed:
        raise RuntimeError(
            f"{run_dir} holds a run with different {' and '.join(changed)} settings; resume it with its own config "
            f"({run_dir / 'config.yaml'}), pick another train.out_dir, or pass train.resume=false to start afresh"
        )
    return tag


def _print_header(cfg: Config, model: Transformer, world: int, G: int, data_meta: dict) -> None:
    from moe_lm.model import count_params

    n = count_params(cfg.model)
    print(
        f"moe-lm: {n.total / 1e6:.2f}M parameters ({n.active / 1e6:.2f}M active per token), "
        f"{len(model.moe_layers())} MoE layers x {cfg.model.moe.n_routed_experts} experts (top-"
        f"{cfg.model.moe.num_experts_per_tok}), world {world}, ZeRO-{cfg.parallel.zero_stage}, "
        f"global batch {G} x {cfg.train.seq_len} tokens; data {cfg.data.out_dir}: "
        f"{data_meta['tokens']['train']:,} train tokens in {len(data_meta['domains'])} domains",
        flush=True,
    )


def _eval_line(ev: dict) -> str:
    domains = " ".join(f"{k[5:]}={v:.3f}" for k, v in ev.items() if k.startswith("loss/"))

    def worst(prefix: str) -> float:
        return max((v for k, v in ev.items() if k.startswith(prefix)), default=0.0)

    return (
        f"eval loss {ev['loss']:.4f} (ppl {ev['ppl']:.1f}) | {domains} | max MaxVio_global "
        f"{worst('maxvio_global/'):.3f} | max domain JSD {worst('domain_jsd/'):.3f} bits"
    )
