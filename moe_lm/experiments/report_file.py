"""An experiment report's results.json read back (report.py writes it): checked for what the results table and the
power estimate read, so that another tool's results.json, an older or hand-made report, or a damaged file is one
line naming it and the first thing that is not what a report holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

from moe_lm.errors import UserError, shown

# what is read of a report, of each of its comparisons and of a probe's checks, with their types
REPORT_FIELDS = {"experiment": str, "claim": str, "verdict": str}
COMPARISON_FIELDS = {"name": str, "role": str, "metric": str, "verdict": str, "mean": (int, float), "t_interval": list,
                     "deltas": list, "expect": str, "margin": (int, float)}  # fmt: skip
CHECK_FIELDS = {"name": str, "role": str, "verdict": str}


def read_report(path: Path) -> dict:
    """The report at `path`, checked; a UserError naming the file and the first thing missing."""

    def refuse(problem: str) -> UserError:
        return UserError(f"{path} is not an experiment report this moe-lm reads ({problem}); move it out of the "
                         "results folder, or write it again with moe-lm experiment")  # fmt: skip

    try:
        r = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise refuse(f"not JSON: {e}") from None
    if not isinstance(r, dict):
        raise refuse(f"a {type(r).__name__}, not an object")
    for key, kind in REPORT_FIELDS.items():
        if not isinstance(r.get(key), kind):
            raise refuse(f"{key} is {shown(r.get(key))}")
    for part, fields in (("comparisons", COMPARISON_FIELDS), ("checks", CHECK_FIELDS)):
        rows = r.get(part, [])
        if not isinstance(rows, list) or not all(isinstance(c, dict) for c in rows):
            raise refuse(f"{part} is {shown(rows)}")
        for c in rows:
            for key, kind in fields.items():
                if not isinstance(c.get(key), kind):
                    raise refuse(f"{part[:-1]} {c.get('name')!r}: {key} is {shown(c.get(key))}")
            interval = c.get("t_interval", [0, 0] if "mean" not in c else None)
            if not isinstance(interval, list) or len(interval) != 2 or not all(_number(x) for x in interval):
                raise refuse(f"{part[:-1]} {c['name']!r}: t_interval is {shown(interval)}")
            if not all(_number(d) and math.isfinite(d) for d in c.get("deltas", [])):
                raise refuse(f"{part[:-1]} {c['name']!r}: deltas {shown(c['deltas'])} are not all finite numbers")
    return r


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
