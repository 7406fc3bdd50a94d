"""What an analysis is asked to do, as typed requests: the command line builds them from its flags (moe_lm/cli/
analyze.py, ablate.py), and a notebook or an experiment builds them by hand; the workflows take them whole.

    from pathlib import Path
    from moe_lm.analysis.requests import RoutingRequest, SubjectRequest
    from moe_lm.analysis.routing_workflow import analyze_routing
    from moe_lm.checkpoint.format import parse_run

    result = analyze_routing(RoutingRequest(SubjectRequest(run=parse_run("runs/tiny")), out=Path("analysis/tiny")))

A workflow writes into `out` as it is (the command line gives it a fresh folder that it renames into place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_lm.checkpoint.format import RunRef

CHART_TOKENS = (".", ",", "the", "(", "def", "\n", "what")  # tokens whose routing across layers is charted


@dataclass(frozen=True)
class SubjectRequest:
    """What is studied, on which documents: a moe-lm run's checkpoint (`run`), a transformers MoE checkpoint folder
    (`hf`), or a GGUF file run in llama.cpp (`gguf`); the last two need `data`."""

    run: RunRef | None = None
    hf: str | None = None
    gguf: str | None = None
    data: tuple[str, ...] = ()  # sources as in data.sources; empty with a run: its validation split
    text_field: str = "text"  # the column (or .jsonl key) with the text
    domain_field: str = "domain"  # the column naming the domain (absent: the source's name)
    dtype: str = "float32"  # with hf: float32 or bfloat16
    device: str = "cpu"  # with hf: cpu, cuda, or auto (device_map="auto")
    # the window length (capped by the model's); None: a run's train.seq_len, a released model's 1024. `analyze`
    # cuts every subject of a comparison into the same windows (routing_workflow.shared_windows)
    seq_len: int | None = None
    threads: int = 1  # with gguf: llama.cpp's threads
    llama_defaults: bool = False  # with gguf: llama.cpp's default f16 KV cache and flash attention
    name: str | None = None  # how a report names it (default: its path)

    @property
    def label(self) -> str:
        """How the subject is named in a report."""
        if self.name:
            return self.name
        if self.gguf:
            return str(self.gguf)
        if self.hf:
            return str(self.hf)
        run, tag = self.run
        return f"{run}:{tag}" if tag else str(run)


@dataclass(frozen=True)
class RoutingRequest:
    """`moe-lm analyze`: record the routing of `max_tokens` tokens (equal shares per domain) and report it."""

    subject: SubjectRequest
    out: Path  # the report folder: trace*/, figures/, routing.html, metrics.json, metrics.csv
    max_tokens: int = 200_000
    batch_size: int = 16  # sequences per forward pass
    # other subjects (a checkpoint of the same run, the run's GGUF export, an HF original) routing the same token
    # ids: their agreement with this one, per layer and domain, and what their flips cost in log-prob
    compare: tuple[SubjectRequest, ...] = ()
    chart_tokens: tuple[str, ...] = CHART_TOKENS
    min_count: int = 20  # minimum occurrences for vocabulary specialisation
    init_baseline: bool = True  # the untrained model's trace (baseline N1)
    layers: tuple[int, ...] | None = None  # MoE layers to draw (None: all up to 8, else first, middle, last)
    wandb: bool = False  # also log the figures to the run's own wandb run


@dataclass(frozen=True)
class AblationRequest:
    """`moe-lm ablate`: route around experts and measure what each domain loses, against random controls."""

    subject: SubjectRequest
    out: Path  # the report folder: ablation.json, ablation.md, ablation.png
    targets: tuple[tuple[int, list[int]], ...] = ()  # (MoE layer, experts); empty: the most specialised ones
    controls: int = 3  # random same-size expert sets per target
    max_documents: int = 400
    n_boot: int = 1000  # bootstrap resamples
