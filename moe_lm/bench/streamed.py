"""Benchmark the streamed analysis of a checkpoint (a layer at a time within --max-memory) against the same analysis
of the whole model in memory, in the same run.

    moe-lm bench streamed                          # a random DeepseekV3 of about 2.5 GB in float32, released as FP8
    moe-lm bench streamed --folder path/to/release --max-memory 8GiB --tokens 20000 --dtype bfloat16

Each arm is `moe-lm analyze --hf FOLDER` (the untrained baseline N1 included) in a process of its own, so that its
peak resident memory (VmHWM, Linux) is its own: "whole" with --max-memory above the weights, "streamed" with
--max-memory as given. The checkpoint's files are dropped from the page cache before each arm (posix_fadvise), so
that both read from the disk as a first analysis does. Reported: each arm's wall time and peak resident memory and
the ratios (targets: streamed <= 1.5 x whole in time, < 0.4 x in peak memory), the streamed arm's read and compute
seconds and its wall time against max(read, compute) (target <= 1.2), and whether both recorded the same experts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_lm.bench.timing import interleave, markdown_table, summarize
from moe_lm.errors import UserError
from moe_lm.files import gib
from moe_lm.flags import byte_size

WORDS = 3000  # the random corpus's vocabulary


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--folder", help="a transformers MoE checkpoint with its tokenizer (default: a random DeepseekV3 "
                    "written as DeepSeek releases its checkpoints, FP8 blocks, into a temporary folder)")  # fmt: skip
    ap.add_argument("--hidden", type=int, default=1024, help="the random DeepseekV3's hidden size")
    ap.add_argument("--layers", type=int, default=8, help="its layers (the first dense)")
    ap.add_argument("--experts", type=int, default=48, help="its routed experts per layer (8 groups, top-4 groups)")
    ap.add_argument("--max-memory", type=byte_size, default=byte_size("1GiB"), help="the streamed arm's budget")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens analysed (--max-tokens), in 3 domains")
    ap.add_argument("--seq-len", type=int, default=512, help="window length")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the analysis dtype")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both arms")


def random_release(folder: Path, hidden: int, layers: int, experts: int) -> None:
    """A random DeepseekV3 written as DeepSeek releases one (FP8 blocks, shards, an index), with a byte-level BPE
    tokenizer of the corpus's words."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moe_lm.interop.released_weights import write_fp8_release

    config = transformers.DeepseekV3Config(
        vocab_size=32_000, hidden_size=hidden, intermediate_size=3 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=experts, num_experts_per_tok=6, n_shared_experts=1, n_group=8, topk_group=4,
        kv_lora_rank=hidden // 2, q_lora_rank=hidden // 2, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=4096, routed_scaling_factor=2.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.01)
    write_fp8_release(model, folder, shards=max(2, layers // 2))
    del model
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([" ".join(_words())], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def _words() -> list[str]:
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(WORDS)]


def corpus(path: Path, tokens: int) -> None:
    """Documents of 50..400 words in 3 domains, each domain preferring its own third of the words, about `tokens`
    tokens and more (the analysis takes --max-tokens of them)."""
    rng = np.random.default_rng(1)
    words = _words()
    with path.open("w") as f:
        n, i = 0, 0
        while n < 2 * tokens:
            domain = i % 3
            own = rng.integers(domain * WORDS // 3, (domain + 1) * WORDS // 3, int(rng.integers(50, 400)))
            text = " ".join(words[w] if rng.random() < 0.7 else words[rng.integers(WORDS)] for w in own)
            f.write(json.dumps({"text": text, "domain": f"d{domain}"}) + "\n")
            n, i = n + 2 * len(own), i + 1


def evict(folder: Path) -> None:
    """Drop the checkpoint's files from the page cache (written back first): the next read comes from the disk."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# the analysis in a child process that says its own peak resident memory as it ends: the high-water mark of its own
# memory map (VmHWM), which a fresh exec starts from zero; wait4's ru_maxrss would keep the parent's, inherited when
# the child was forked from it
CHILD = """
import sys
from moe_lm.cli.main import main
try:
    main(sys.argv[1:])
finally:
    with open("/proc/self/status") as status:
        print(*[line for line in status if line.startswith("VmHWM")], file=sys.stderr)
"""


def analysis(folder: Path, data: Path, out: Path, args: argparse.Namespace, max_memory: int) -> dict[str, float]:
    """`moe-lm analyze --hf folder` in a process of its own: wall seconds, peak resident bytes, and the streamed
    run's timing (the trace's meta.json)."""
    shutil.rmtree(out, ignore_errors=True)
    evict(folder)
    cmd = [sys.executable, "-c", CHILD, "analyze", "--hf", str(folder), "--data", str(data), "--out", str(out),
           "--max-tokens", str(args.tokens), "--seq-len", str(args.seq_len), "--dtype", args.dtype,
           "--max-memory", str(max_memory)]  # fmt: skip
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    said = log.read_text()
    if code != 0:
        raise UserError(f"the analysis failed (moe-lm {' '.join(cmd[3:])}):\n{said[-3000:]}")
    peak = re.findall(r"VmHWM:\s+(\d+) kB", said)
    if not peak:
        raise UserError("the analysis did not say its peak memory (/proc/self/status): this benchmark needs Linux")
    streamed = json.loads((out / "trace" / "meta.json").read_text()).get("streamed") or {}
    return {"seconds": seconds, "peak": int(peak[-1]) * 1024, **{k: float(v) for k, v in streamed.items()}}


def same_experts(a: Path, b: Path) -> bool:
    from moe_lm.routing.trace import Trace

    x, y = Trace(a), Trace(b)
    return x.layers == y.layers and all(np.array_equal(x.experts(layer), y.experts(layer)) for layer in x.layers)


def run(args: argparse.Namespace) -> None:
    if min(args.hidden, args.layers, args.experts, args.tokens, args.seq_len, args.rounds) < 1:
        raise UserError("--hidden, --layers, --experts, --tokens, --seq-len and --rounds must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="bench_streamed_"))
    try:
        folder = Path(args.folder) if args.folder else work / "release"
        if not args.folder:
            print(f"writing a random DeepseekV3 (hidden {args.hidden}, {args.layers} layers, {args.experts} experts) "
                  f"as an FP8 release into {folder} ...")  # fmt: skip
            random_release(folder, args.hidden, args.layers, args.experts)
        data = work / "corpus.jsonl"
        corpus(data, args.tokens)
        on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        measures = {
            "whole": lambda: analysis(folder, data, work / "whole", args, 1 << 50),
            "streamed": lambda: analysis(folder, data, work / "streamed", args, args.max_memory),
        }
        samples = interleave(measures, args.rounds)
        both = summarize({arm: {m: got[m] for m in ("seconds", "peak")} for arm, got in samples.items()})
        streamed = summarize({"streamed": samples["streamed"]})["streamed"]  # its layers' timing too
        same = same_experts(work / "whole" / "trace", work / "streamed" / "trace")
        print(f"{folder}: {gib(on_disk)} on disk; {args.tokens:,} tokens in windows of {args.seq_len}, {args.dtype}, "
              f"streamed within --max-memory {gib(args.max_memory)}; median of {args.rounds} round(s), one process "
              "per analysis, the files dropped from the page cache before each")  # fmt: skip
        print(report(both, streamed, same))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(stats, part, same: bool) -> str:
    """The arms' table, the streamed layers' rates, and the ratios against their targets."""
    whole = stats["whole"]
    rows = [[name, f"{s['seconds'].median:.1f}", f"{s['seconds'].ratio:.2f}", gib(s["peak"].median),
             f"{s['peak'].ratio:.2f}"] for name, s in stats.items()]  # fmt: skip
    table = markdown_table(["analysis", "wall s", "vs whole", "peak resident", "vs whole"], rows)
    read, compute, wall = part["read_s"].median, part["compute_s"].median, part["wall_s"].median
    rates = (f"streamed layers: read {gib(part['read_bytes'].median)} in {read:.1f} s "
             f"({part['read_bytes'].median / 1e6 / max(read, 1e-9):,.0f} MB/s), {part['flops'].median / 1e9:,.0f} "
             f"GFLOP in {compute:.1f} s ({part['flops'].median / 1e9 / max(compute, 1e-9):,.1f} GFLOP/s), wall "
             f"{wall:.1f} s = {wall / max(read, compute, 1e-9):.2f} x max(read, compute) (target <= 1.2); planned "
             f"{part['planned_s'].median:.1f} s")  # fmt: skip
    verdict = (f"streamed / whole: time {part['seconds'].median / whole['seconds'].median:.2f} (target <= 1.5), peak "
               f"memory {part['peak'].median / whole['peak'].median:.2f} (target < 0.4, and under 2 GiB: "
               f"{gib(part['peak'].median)}); the same experts for every (token, layer): "
               f"{'yes' if same else 'NO'}")  # fmt: skip
    return "\n".join([table, rates, verdict])
