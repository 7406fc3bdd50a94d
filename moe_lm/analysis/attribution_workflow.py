"""The drift split of `moe-lm analyze --attribute`, from a request to its files: which models' drift from the run
splits (the run itself in another dtype; each subject whose kind builds its weights in the run's architecture,
`SubjectKind.in_architecture`), refused before the long analysis when none does; then, once the run's trace is
recorded, the split on its documents and windows (attribution.py), written as attribution.json and attribution.md.
`moe-lm analyze` (moe_lm/cli/analyze.py) parses the flags, calls both and prints the table."""

from __future__ import annotations

from moe_lm.analysis.attribution import attribute_models
from moe_lm.analysis.requests import AttributionRequest
from moe_lm.analysis.subjects import NotInArchitecture, RunSubject, kind_of
from moe_lm.analysis.subjects.base import WeightsBuilder
from moe_lm.errors import UserError
from moe_lm.routing.trace import Trace

ATTRIBUTE_DTYPES = ("bfloat16", "float16")  # the run's other dtypes whose drift splits against float32


def drift_models(req: AttributionRequest) -> dict[str, WeightsBuilder]:
    """Label -> a builder of each model whose drift splits: the run in each dtype, each other subject whose weights
    run in the run's architecture; the others named (one line each) and left out, a UserError when none is left."""
    models = {f"{req.run.spec} in {dtype}": in_dtype(req.run, dtype) for dtype in req.dtypes}
    for other in req.others:
        try:
            models[other.label] = kind_of(other).in_architecture(other, req.run)
        except NotInArchitecture as why:
            print(f"--attribute: {other.label} is not split ({why})")
    if not models:
        raise UserError(f"--attribute: no compared model runs in the architecture of {req.run.spec}; give --quantise "
                        "TYPE (MLA runs), --attribute-dtype DTYPE or --compare CHECKPOINT|HF_FOLDER|GGUF of the run's "
                        "shape, or drop --attribute")  # fmt: skip
    return models


def split_drift(req: AttributionRequest, models: dict[str, WeightsBuilder]) -> dict:
    """The drift of each model of `drift_models` split into weights and routing on the documents and windows of the
    run's trace (`req.out`/trace); writes attribution.json and attribution.md into `req.out`."""
    try:
        return attribute_models(req.run.run, Trace(req.out / "trace"), models, req.out, req.n_boot)
    except ValueError as e:
        raise UserError(f"--attribute {e}") from None


def in_dtype(run: RunSubject, dtype: str) -> WeightsBuilder:
    """A builder of the run's own model with weights and compute in `dtype` (one of ATTRIBUTE_DTYPES)."""
    import torch

    from moe_lm.checkpoint.format import load_model

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return lambda cfg: load_model(*run.run)[1].to(torch_dtype)
