"""Benchmark preparation's tokenizing pass: 1 and 2 worker processes against the tokenizer's own encode speed.

    python -m moe_lm.bench prepare                              # the embedded corpus, its trained tokenizer
    python -m moe_lm.bench prepare --repeat 2                   # a shorter stream (start-up weighs more)

The ceiling is the tokenizer's `encode` over the same texts held in memory, in this process, in the same run.
Rounds are interleaved (ceiling, 1 worker, 2 workers, ...) so that machine noise hits all alike; medians are
reported. Per-worker efficiency = tokens/s of 1 worker / ceiling; speed-up = 2 workers / 1 worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from moe_lm.bench.timing import markdown_table, time_interleaved
from moe_lm.config import Config, load_config, preset_path
from moe_lm.data.documents import ReadReport
from moe_lm.data.prepare import iter_documents, prepare_data, read_meta
from moe_lm.data.tokenize_shards import tokenize_to_shards
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.errors import UserError

CEILING = "encode (ceiling)"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="tiny", metavar="NAME|FILE",
                    help="its data section is prepared (into a temporary folder) and tokenized")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three arms")
    ap.add_argument("--repeat", type=int, default=4, help="the corpus this many times over (a longer stream)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.max_mb_per_domain=1")


def write_stream(cfg: Config, stream: Path, repeat: int) -> tuple[list[str], dict[str, str]]:
    """The corpus `repeat` times over as JSON lines in `stream` (each copy's names made unique); its texts in
    order, and every name's split (all train)."""
    docs = [{"name": d.name, "domain": d.domain, "text": d.text} for d in iter_documents(cfg.data, ReadReport())]
    with open(stream, "w", encoding="utf-8") as f:
        for r in range(repeat):
            for d in docs:
                f.write(json.dumps({**d, "name": f"{d['name']}#{r}"}) + "\n")
    split_of = {f"{d['name']}#{r}": "train" for r in range(repeat) for d in docs}
    return [d["text"] for d in docs] * repeat, split_of


def arms(tok, texts: list[str], tokenize: Callable[[int], None]) -> dict[str, Callable[[], None]]:
    def ceiling() -> None:
        for t in texts:
            tok.encode(t)

    return {CEILING: ceiling, "1 worker": lambda: tokenize(1), "2 workers": lambda: tokenize(2)}


def run(args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.repeat < 1:
        raise UserError("--rounds and --repeat must be >= 1")
    cfg = load_config(preset_path(args.config), args.overrides)
    work = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        data = prepare_data(dataclasses.replace(cfg.data, out_dir=str(work / "data")), cfg.model.vocab_size, log=print)
        stream = work / "documents.jsonl"
        texts, split_of = write_stream(cfg, stream, args.repeat)
        domains = read_meta(data)["domains"]
        tok = load_data_tokenizer(data)
        n_tokens = sum(len(tok.encode(t)) + 1 for t in texts)

        def tokenize(n: int) -> None:
            out = work / f"out{n}"
            shutil.rmtree(out, ignore_errors=True)
            tokenize_to_shards(stream, split_of, domains, data, out, n)

        stats = time_interleaved(arms(tok, texts, tokenize), args.rounds)
        rate = {name: n_tokens / s.median for name, s in stats.items()}
        mb = stream.stat().st_size / 1e6
        print(f"# {len(texts):,} documents, {mb:.1f} MB of JSON lines, {n_tokens:,} tokens, {tok.kind} tokenizer "
              f"({tok.vocab_size} pieces); median of {args.rounds} interleaved rounds")  # fmt: skip
        rows = [[name, f"{r:,.0f}", f"{r / rate[CEILING]:.2f}"] for name, r in rate.items()]
        print(markdown_table(["arm", "tokens/s", "vs ceiling"], rows))
        print(f"per-worker efficiency {rate['1 worker'] / rate[CEILING]:.2f} (target >= 0.80); "
              f"2 workers / 1 worker {rate['2 workers'] / rate['1 worker']:.2f} (target >= 1.70)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
