"""The README's quick tour, run exactly as printed in an empty folder: every command of the section between the
quick-tour markers (shell lines through bash, the Python block through python), in order. Each must succeed and
print the lines the README shows (numbers may differ: another machine, another corpus size); the text the model
generates is not compared with the README but between moe-lm and transformers, which must agree."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"\d[\d,.]*")


def tour() -> list[tuple[str, str, str]]:
    """(language, code, the output block printed after it) for each command of the quick tour."""
    text = ROOT.joinpath("README.md").read_text()
    section = text[text.index("<!-- quick-tour") : text.index("<!-- /quick-tour -->")]
    blocks = FENCE.findall(section)
    steps = []
    for (lang, code), nxt in zip(blocks, [*blocks[1:], ("", "")], strict=True):
        if lang in ("bash", "python"):
            steps.append((lang, code, nxt[1] if nxt[0] == "text" else ""))
    return steps


def shown(expected: str, actual: str) -> list[str]:
    """The README's output lines that the actual output lacks (numbers masked; `...` stands for anything)."""
    missing = []
    for line in expected.splitlines():
        pieces = [NUMBER.sub("#", p.strip()) for p in line.split("...")]
        found = any(_in_order(pieces, NUMBER.sub("#", got)) for got in actual.splitlines())
        if not found:
            missing.append(line)
    return missing


def _in_order(pieces: list[str], line: str) -> bool:
    at = 0
    for piece in pieces:
        at = line.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def test_the_quick_tour_runs_as_printed(tmp_path, process):
    env = process.clean_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    outputs = {}
    for lang, code, expected in tour():
        cmd = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = process.run(cmd, env=env, cwd=tmp_path, timeout=900)
        assert proc.returncode == 0, (code, proc.stdout[-2000:], proc.stderr[-3000:])
        key = "python" if lang == "python" else code.split()[1]
        outputs[key] = proc.stdout
        if key not in ("generate", "python"):  # what the model says is compared below, not with the README
            assert not shown(expected, proc.stdout + proc.stderr), (code, shown(expected, proc.stdout + proc.stderr))
    # transformers' greedy continuation of the exported model is moe-lm's own (it may stop earlier, at EOS)
    name, text = outputs["python"].strip().split(" ", 1)
    assert name == "DeepseekV3ForCausalLM"
    hf = ast.literal_eval(text).removeprefix("<s>").removeprefix(" ")
    ours = outputs["generate"].removesuffix("\n")
    assert ours.startswith(hf) and len(hf) > len("def parse("), (hf, ours)
