"""Benchmark preparation's tokenizing pass: 1 and 2 worker processes against the tokenizer's own encode speed.

    python launch/bench_prepare.py                              # the embedded corpus, its trained tokenizer
    python launch/bench_prepare.py --repeat 2                   # a shorter stream (start-up weighs more)

The ceiling is the tokenizer's `encode` over the same texts held in memory, in this process, in the same run.
Rounds are interleaved (ceiling, 1 worker, 2 workers, ...) so that machine noise hits all alike; medians are
reported. Per-worker efficiency = tokens/s of 1 worker / ceiling; speed-up = 2 workers / 1 worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from moe_lm.cli import run
from moe_lm.config import load_config
from moe_lm.data.documents import ReadReport
from moe_lm.data.prepare import iter_documents, prepare_data, read_meta
from moe_lm.data.tokenize_shards import tokenize_to_shards
from moe_lm.data.tokenizer import load_data_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=4, help="the corpus this many times over (a longer stream)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    work = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        data = prepare_data(dataclasses.replace(cfg.data, out_dir=str(work / "data")), cfg.model.vocab_size, log=print)
        docs = [{"name": d.name, "domain": d.domain, "text": d.text} for d in iter_documents(cfg.data, ReadReport())]
        stream = work / "documents.jsonl"
        with open(stream, "w", encoding="utf-8") as f:
            for r in range(args.repeat):
                for d in docs:
                    f.write(json.dumps({**d, "name": f"{d['name']}#{r}"}) + "\n")
        split_of = {f"{d['name']}#{r}": "train" for r in range(args.repeat) for d in docs}
        domains = read_meta(data)["domains"]
        tok = load_data_tokenizer(data)
        texts = [d["text"] for d in docs] * args.repeat
        n_tokens = sum(len(tok.encode(t)) + 1 for t in texts)

        def ceiling() -> None:
            for t in texts:
                tok.encode(t)

        def workers(n: int):
            def run() -> None:
                out = work / f"out{n}"
                shutil.rmtree(out, ignore_errors=True)
                tokenize_to_shards(stream, split_of, domains, data, out, n)

            return run

        arms = {"encode (ceiling)": ceiling, "1 worker": workers(1), "2 workers": workers(2)}
        seconds: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - t0)
        rate = {name: n_tokens / statistics.median(s) for name, s in seconds.items()}
        mb = stream.stat().st_size / 1e6
        print(f"# {len(texts):,} documents, {mb:.1f} MB of JSON lines, {n_tokens:,} tokens, {tok.kind} tokenizer "
              f"({tok.vocab_size} pieces); median of {args.rounds} interleaved rounds")  # fmt: skip
        print("| arm | tokens/s | vs ceiling |")
        print("|---|---|---|")
        for name in arms:
            print(f"| {name} | {rate[name]:,.0f} | {rate[name] / rate['encode (ceiling)']:.2f} |")
        print(f"per-worker efficiency {rate['1 worker'] / rate['encode (ceiling)']:.2f} (target >= 0.80); "
              f"2 workers / 1 worker {rate['2 workers'] / rate['1 worker']:.2f} (target >= 1.70)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    run(main)
