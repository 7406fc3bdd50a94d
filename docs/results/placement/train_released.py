"""Train a small MoE of a released architecture (transformers' Qwen3MoeForCausalLM by default) on a moe-lm data
folder: the released architecture of docs/results/placement/README.md (a result's script, not a moe-lm command).

Why: moe-lm's own runs (runs/d256) route with DeepSeek-V3's sigmoid gate, shared expert and bias balancing. To tell
which routing statistics belong to that design and which to any learned MoE, the same data also trains a released
architecture as transformers ships it: softmax gate, top-k, no shared expert, the Switch-style balancing loss on
(router_aux_loss_coef, as in the release). The result is a transformers folder with the data's tokenizer, so that
`moe-lm analyze --hf` reads it like any released checkpoint.

    python docs/results/placement/train_released.py                  # data/default -> runs/qwen3moe-d256, 600 steps
    python docs/results/placement/train_released.py --steps 300 --out runs/qwen3moe-short
    python docs/results/placement/train_released.py --config '{"num_experts": 16}' --out runs/qwen3moe-16e
    moe-lm analyze --hf runs/qwen3moe-d256 --data DOCS.jsonl --out analysis_qwen3moe

Trains on CPU or the first GPU, float32, one process. Prints the loss every 50 steps and the validation loss (per
domain) at the end. On a CPU that other processes share, run it with OMP_WAIT_POLICY=PASSIVE: OpenMP threads that
spin while they wait made a step 4x slower (11.6 s against 2.8 s on 2 busy cores; it must be set before torch loads).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from moe_lm.data.batches import TrainWindows, eval_windows
from moe_lm.data.prepare import load_split, read_meta
from moe_lm.interop.hf_tokenizer import export_tokenizer

# runs/d256's shape (dim 256, 4 layers, 8 experts top-2, expert width 256, 8 heads / 2 KV heads of 32) in Qwen3Moe's
# terms. Every layer is MoE (Qwen3's mlp_only_layers is empty), so intermediate_size (a dense MLP's width) is unused.
QWEN3MOE = dict(
    model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=256, tie_word_embeddings=False, norm_topk_prob=True,
    output_router_logits=True, router_aux_loss_coef=0.001,
)  # fmt: skip
# Note: transformers' load_balancing_loss_func pools the top-k counts and router probabilities of all layers before
# the product (huggingface/transformers#28255, #31464), so one layer's imbalance can cancel another's: at 200 steps it
# read 2.04 (2.0 = balanced) while each layer alone read 2.9-3.7, one expert per layer taking up to 47 % of the load.


def model_config(data_dir: str, override: str | None):
    """The transformers config: QWEN3MOE, then --config (a JSON file or a JSON object), then the data's vocabulary
    and special tokens (the model must embed every id the tokenizer gives)."""
    settings = dict(QWEN3MOE)
    if override:
        settings.update(json.loads(Path(override).read_text() if Path(override).is_file() else override))
    meta = read_meta(data_dir)
    tok = meta.get("tokenizer", {})
    settings.update(vocab_size=meta["vocab_size"], bos_token_id=tok.get("bos_id"), eos_token_id=tok.get("eos_id"))
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak (as moe-lm's schedule ends at min_lr = lr / 10)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def lm_loss(model, windows: torch.Tensor):
    """Next-token cross-entropy of [n, L + 1] windows, and the balancing loss. Why not `labels=`: transformers shifts
    labels itself, so it would need L + 1 positions, one past max_position_embeddings."""
    out = model(input_ids=windows[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    return ce, out.aux_loss


@torch.no_grad()
def validate(model, data_dir: str, seq_len: int, batch: int, n_batches: int, device) -> dict[str, float]:
    """Mean loss per domain of the validation split's fixed windows (about n_batches x batch in all), and overall."""
    model.eval()
    val = load_split(data_dir, "val")
    per_domain = math.ceil(n_batches * batch / len(val.domains))
    losses, total, count = {}, 0.0, 0
    for domain, windows in eval_windows(val, seq_len, per_domain).items():
        parts = [lm_loss(model, w.to(device))[0].item() * w[:, 1:].numel() for w in windows.split(batch)]
        losses[domain] = sum(parts) / windows[:, 1:].numel()
        total, count = total + sum(parts), count + windows[:, 1:].numel()
    model.train()
    return {"all": total / count, **losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/default", help="a prepared moe-lm data folder")
    ap.add_argument("--out", default="runs/qwen3moe-d256", help="the transformers folder written at the end")
    ap.add_argument("--config", help="config settings over the defaults: a JSON file or a JSON object")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="windows per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=20, help="validation windows: about this many batches")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (the machine this was made on has 2 cores)")
    args = ap.parse_args()
    if Path(args.out).exists() and any(Path(args.out).iterdir()):  # never write into a folder moe-lm did not create
        ap.error(f"--out {args.out} exists and is not empty: give a new folder")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # why: the initial weights, hence the whole run, depend on nothing else
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(args.data, args.config)
    if args.seq_len > config.max_position_embeddings:
        ap.error(f"--seq-len {args.seq_len} is beyond the model's max_position_embeddings")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    print(f"{config.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters on {device}")

    # The project's own sampler: sample i of the run is a pure function of (seed, i), documents packed with BOS.
    windows = TrainWindows(load_split(args.data, "train"), args.seq_len, args.seed)
    # AdamW as moe-lm's runs use it (betas 0.9/0.95, weight decay 0.1, gradients clipped at 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        ce, aux = lm_loss(model, windows.batch(step * args.batch, args.batch).to(device))
        # why the model's own coefficient: it is the release's setting, saved in config.json with the weights
        loss = ce + config.router_aux_loss_coef * aux if aux is not None else ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 in (1, args.steps):
            aux_text = f"  balance {aux.item():.4f}" if aux is not None else ""
            print(f"step {step + 1:5d}  loss {ce.item():.4f}{aux_text}  lr {lr_at(step, args):.2e}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip

    val = validate(model, args.data, args.seq_len, args.batch, args.eval_batches, device)
    print("validation loss " + "  ".join(f"{k} {v:.4f}" for k, v in val.items()))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # new or empty: checked before training
    model.save_pretrained(out)
    # the project's export of its tokenizer: checked to give the training ids, BOS first, under AutoTokenizer
    print(f"wrote {out}: the model, and " + export_tokenizer(args.data, out, max_len=config.max_position_embeddings))


if __name__ == "__main__":
    main()
