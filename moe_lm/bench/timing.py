"""The method every benchmark shares: variants measured in interleaved rounds (each variant once per round, round
after round, so that a shared machine's noise hits all of them alike), warm-up rounds left out, then medians, the
spread and ratios to a reference variant, and the markdown table they are printed as.

    stats = time_interleaved({"ours": ours, "dense": dense}, rounds=10, warmup=3)   # wall time of callables
    stats["ours"].median, stats["dense"].ratio                                       # seconds; dense / ours

A measurement need not be a wall time: `interleave` takes functions that return a dict of named numbers (peak
bytes from a child process, tokens/s), and `summarize` reduces every number the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

Measurement = Callable[[], Mapping[str, float]]  # one measurement of one variant: named numbers
Samples = dict[str, dict[str, list[float]]]  # variant -> metric -> one number per measured round
RoundHook = Callable[[int], None]  # called with the round's index (warm-up rounds included, from 0)


@dataclass(frozen=True)
class Stat:
    """One metric of one variant over the measured rounds; `ratio` = median / the reference variant's median."""

    median: float
    min: float
    max: float
    ratio: float


def no_sync() -> None:
    """The default `sync`: nothing is queued asynchronously (CPU work)."""


def interleave(
    measures: Mapping[str, Measurement],
    rounds: int,
    warmup: int = 0,
    *,
    rotate: bool = False,
    before_round: RoundHook | None = None,
    after_round: RoundHook | None = None,
) -> Samples:
    """`warmup` + `rounds` rounds, each calling every measurement once in the order given (with `rotate`, round r
    starts at variant r mod n: no variant always goes first); the numbers of the warm-up rounds are dropped.
    `before_round` prepares what all variants of a round share (a batch), `after_round` checks what they made."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need at least 1 measured round and no negative warm-up, got {rounds} and {warmup}")
    names = list(measures)
    samples: Samples = {name: {} for name in names}
    for r in range(warmup + rounds):
        if before_round is not None:
            before_round(r)
        start = r % len(names) if rotate else 0
        for name in names[start:] + names[:start]:
            numbers = measures[name]()
            if r >= warmup:
                for metric, value in numbers.items():
                    samples[name].setdefault(metric, []).append(float(value))
        if after_round is not None:
            after_round(r)
    return samples


def timed(
    fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = no_sync
) -> Measurement:
    """A measurement of `fn`'s wall time, {"seconds": ...}; `sync` (e.g. torch.cuda.synchronize) runs before the
    clock starts and before it stops, so that queued device work is inside the measured interval and only there."""

    def measure() -> dict[str, float]:
        sync()
        t0 = clock()
        fn()
        sync()
        return {"seconds": clock() - t0}

    return measure


def summarize(samples: Samples, reference: str | None = None) -> dict[str, dict[str, Stat]]:
    """Median, min and max of every variant's every metric, and its median's ratio to `reference`'s (default: the
    first variant; nan where the reference's median is 0)."""
    ref = samples[reference if reference is not None else next(iter(samples))]
    stats: dict[str, dict[str, Stat]] = {}
    for name, metrics in samples.items():
        stats[name] = {}
        for metric, values in metrics.items():
            median, base = statistics.median(values), statistics.median(ref[metric])
            stats[name][metric] = Stat(median, min(values), max(values), median / base if base else float("nan"))
    return stats


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 0,
    *,
    reference: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = no_sync,
    before_round: RoundHook | None = None,
) -> dict[str, Stat]:
    """Seconds per call of each callable (median, min, max, ratio to `reference`), timed in interleaved rounds."""
    measures = {name: timed(fn, clock, sync) for name, fn in fns.items()}
    samples = interleave(measures, rounds, warmup, before_round=before_round)
    return {name: metrics["seconds"] for name, metrics in summarize(samples, reference).items()}


def markdown_row(cells: Sequence[object]) -> str:
    """`| a | b |`: cells formatted by the caller (str() of anything else)."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]] = ()) -> str:
    """Header, separator and rows as markdown lines; without rows, the header a caller prints before streaming its
    rows one `markdown_row` at a time (long benchmarks show each row as soon as it is measured)."""
    return "\n".join([markdown_row(columns), "|" + "---|" * len(columns), *map(markdown_row, rows)])
