"""What an analysis is asked to do, as typed requests: the command line builds them from its flags (moe_lm/cli/
analyze.py, ablate.py), and a notebook or an experiment builds them by hand; the workflows take them whole. The
subject is a request of its kind (moe_lm/analysis/subjects/: RunSubject, HFSubject, GGUFSubject, ...), the documents
a `Documents`.

    from pathlib import Path
    from moe_lm.analysis.requests import RoutingRequest
    from moe_lm.analysis.routing_workflow import analyze_routing
    from moe_lm.analysis.subjects import RunSubject
    from moe_lm.checkpoint.format import parse_run

    result = analyze_routing(RoutingRequest(RunSubject(parse_run("runs/tiny")), out=Path("analysis/tiny")))

A workflow writes into `out` as it is (the command line gives it a fresh folder that it renames into place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_lm.analysis.documents import Documents
from moe_lm.analysis.subjects import RunSubject, SubjectRequest

CHART_TOKENS = (".", ",", "the", "(", "def", "\n", "what")  # tokens whose routing across layers is charted


@dataclass(frozen=True)
class RoutingRequest:
    """`moe-lm analyze`: record the routing of `max_tokens` tokens (equal shares per domain) and report it."""

    subject: SubjectRequest
    out: Path  # the report folder: trace*/, figures/, routing.html, metrics.json, metrics.csv
    documents: Documents = Documents()  # default: the documents the subject brings (a run's validation split)
    max_tokens: int = 200_000
    batch_size: int = 16  # windows per forward pass (fewer where their logits would not fit: recording.py)
    # other subjects (a checkpoint of the same run, the run's GGUF export, an HF original) routing the same token
    # ids in the same windows: their agreement with this one, per layer and domain, and what their flips cost
    compare: tuple[SubjectRequest, ...] = ()
    chart_tokens: tuple[str, ...] = CHART_TOKENS
    min_count: int = 20  # minimum occurrences for vocabulary specialisation (at least 2)
    init_baseline: bool = True  # the untrained model's trace (baseline N1)
    layers: tuple[int, ...] | None = None  # MoE layers to draw (None: all up to 8, else first, middle, last)
    wandb: bool = False  # also log the figures to the run's own wandb run (a subject that is a moe-lm run's)
    # where a subject streamed from disk keeps its work, so that the same analysis resumes it (moe-lm analyze:
    # `.<out>.stream/` beside the report, moe_lm/analysis/stream_work.py); None: a temporary folder
    work: Path | None = None


@dataclass(frozen=True)
class AttributionRequest:
    """`moe-lm analyze --attribute`: where the log-prob change of each other model from the run comes from (weights,
    routing: flips and gate values), on the documents and windows of the run's trace in `out`."""

    run: RunSubject
    out: Path  # the report folder holding trace/; attribution.json and attribution.md are written there
    others: tuple[SubjectRequest, ...] = ()  # each split where its weights run in the run's architecture
    dtypes: tuple[str, ...] = ()  # the run itself computed in each of these dtypes, against float32
    n_boot: int = 1000  # bootstrap resamples of documents


@dataclass(frozen=True)
class AblationRequest:
    """`moe-lm ablate`: route around experts and measure what each domain loses, against random controls."""

    subject: SubjectRequest  # a kind whose routers can be routed around (run, hf)
    out: Path  # the report folder: ablation.json, ablation.md, ablation.png
    documents: Documents = Documents()
    targets: tuple[tuple[int, list[int]], ...] = ()  # (MoE layer, experts); empty: the most specialised ones
    controls: int = 3  # random same-size expert sets per target
    max_documents: int = 400
    n_boot: int = 1000  # bootstrap resamples
