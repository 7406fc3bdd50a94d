"""The shared timing method: the order variants run in, what the warm-up rounds leave out, medians, spread and
ratios against hand-computed values on a fake clock, and the markdown table."""

from __future__ import annotations

import math

import pytest

from moe_lm.bench.timing import (
    Stat,
    interleave,
    markdown_row,
    markdown_table,
    summarize,
    time_interleaved,
    timed,
)


def recording(log: list, names: list[str]) -> dict:
    return {name: (lambda name=name: log.append(name) or {"n": len(log)}) for name in names}


def test_every_variant_runs_once_per_round_in_order_with_the_hooks_around_each_round():
    log: list = []
    samples = interleave(
        recording(log, ["a", "b", "c"]),
        rounds=2,
        warmup=1,
        before_round=lambda r: log.append(f"before {r}"),
        after_round=lambda r: log.append(f"after {r}"),
    )
    rounds = [["before 0", "a", "b", "c", "after 0"], ["before 1", "a", "b", "c", "after 1"]]
    assert log == [*rounds[0], *rounds[1], "before 2", "a", "b", "c", "after 2"]
    # the warm-up round's numbers are dropped: a's log lengths at rounds 1 and 2 only
    assert samples == {"a": {"n": [7.0, 12.0]}, "b": {"n": [8.0, 13.0]}, "c": {"n": [9.0, 14.0]}}


def test_rotate_starts_each_round_at_the_next_variant():
    log: list = []
    interleave(recording(log, ["a", "b", "c"]), rounds=4, rotate=True)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


class FakeClock:
    """Time advances only when a timed function says so; every reading and sync is logged."""

    def __init__(self) -> None:
        self.now, self.log = 0.0, []

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now

    def sync(self) -> None:
        self.log.append("sync")

    def takes(self, seconds: list[float]):
        durations = iter(seconds)

        def fn() -> None:
            self.log.append("fn")
            self.now += next(durations)

        return fn


def test_medians_spread_and_ratios_on_a_fake_clock_leave_the_warm_up_out():
    clock = FakeClock()
    fns = {"a": clock.takes([100.0, 3.0, 1.0, 2.0, 4.0]), "b": clock.takes([100.0, 6.0, 9.0, 6.0, 7.0])}
    stats = time_interleaved(fns, rounds=4, warmup=1, clock=clock, sync=clock.sync)
    assert stats["a"] == Stat(median=2.5, min=1.0, max=4.0, ratio=1.0)  # median of 1, 2, 3, 4
    assert stats["b"] == Stat(median=6.5, min=6.0, max=9.0, ratio=6.5 / 2.5)


def test_a_reference_other_than_the_first():
    clock = FakeClock()
    fns = {"a": clock.takes([2.0, 4.0, 3.0]), "b": clock.takes([8.0, 8.0, 1.0])}
    stats = time_interleaved(fns, rounds=3, clock=clock, reference="b")
    assert stats["a"].median == 3.0 and stats["b"].median == 8.0
    assert stats["a"].ratio == pytest.approx(3.0 / 8.0) and stats["b"].ratio == 1.0


def test_timed_syncs_inside_the_clock_readings():
    clock = FakeClock()
    assert timed(clock.takes([0.25]), clock, clock.sync)() == {"seconds": 0.25}
    assert clock.log == ["sync", "clock", "fn", "sync", "clock"]


def test_measurements_of_several_named_numbers_are_summarized_each():
    samples = {"plain": {"peak": [4.0, 2.0, 3.0], "seconds": [1.0, 1.0, 1.0]},
               "chunk": {"peak": [1.0, 1.0, 0.5], "seconds": [2.0, 3.0, 2.5]}}  # fmt: skip
    stats = summarize(samples)
    assert stats["chunk"]["peak"] == Stat(1.0, 0.5, 1.0, 1.0 / 3.0)
    assert stats["chunk"]["seconds"] == Stat(2.5, 2.0, 3.0, 2.5)
    assert stats["plain"]["peak"].ratio == 1.0
    # a reference whose median is 0 gives no ratio rather than an exception
    assert math.isnan(summarize({"a": {"x": [0.0]}, "b": {"x": [1.0]}})["b"]["x"].ratio)


def test_a_run_needs_a_measured_round():
    with pytest.raises(ValueError, match="at least 1 measured round"):
        interleave({"a": lambda: {}}, rounds=0)
    with pytest.raises(ValueError, match="negative warm-up"):
        interleave({"a": lambda: {}}, rounds=1, warmup=-1)


def test_markdown_table():
    assert markdown_row(["plain", 1.5, "x"]) == "| plain | 1.5 | x |"
    assert markdown_table(["arm", "ms"], [["a", "1.0"], ["b", "2.0"]]) == (
        "| arm | ms |\n|---|---|\n| a | 1.0 |\n| b | 2.0 |"
    )
    # without rows: the header a streaming benchmark prints first
    assert markdown_table(["d", "I", "E"]) == "| d | I | E |\n|---|---|---|"
