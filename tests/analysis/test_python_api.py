"""The routing analysis from Python, as docs/analytics.md shows it: its example block, run on a shared trained run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_python_example_in_the_analytics_docs_runs(trained_run, tmp_path, capsys):
    text = ROOT.joinpath("docs", "analytics.md").read_text()
    block = re.search(r"<!-- python-api -->\n```python\n(.*?)```\n<!-- /python-api -->", text, re.S)
    assert block, "docs/analytics.md lost its python-api example"
    code = (
        block[1]
        .replace('"runs/tiny"', repr(str(trained_run())))
        .replace('"analysis/tiny-api"', repr(str(tmp_path / "a")))
    )
    exec(compile(code, "docs/analytics.md", "exec"), {})
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"^\d+ ", line)]
    assert lines and all(float(maxvio) >= 0 and float(jsd) >= 0 for _, maxvio, jsd in lines)
    assert (tmp_path / "a" / "metrics.json").is_file() and (tmp_path / "a" / "routing.html").is_file()
