"""`RoutingRequest.wandb` (`moe-lm analyze --wandb`): the report's figures and per-domain shares attached to the
wandb run of the moe-lm run the subject is a checkpoint of (offline runs sync later); a subject of another kind has
none, and is said so."""

from __future__ import annotations

import sys
from pathlib import Path

from moe_lm.analysis.subjects import TrainingRun


def log_to_wandb(run: TrainingRun | None, report: Path, result: dict) -> None:
    """The figures in `report`/figures and the per-domain expert shares of `result`, logged to `run`'s wandb run."""
    if run is None:
        print("warning: --wandb: only a moe-lm run has a wandb run to log to", file=sys.stderr)
        return
    from moe_lm.train.tracker import open_wandb

    wandb = open_wandb(run.cfg.logging, run.folder, create=False)
    if wandb is None:
        return
    data = {f"routing/{p.stem}": wandb.Image(str(p)) for p in sorted((report / "figures").glob("*.png"))}
    domains = result["trace"]["domains"]
    table = wandb.Table(columns=["layer", "domain", "expert", "token_share", "relative_load"])
    for layer, lm in result["layers"].items():
        for d, name in enumerate(domains):
            for e, share in enumerate(lm["domain_token_share"][d]):
                table.add_data(int(layer), name, e, share, lm["domain_relative_load"][d][e])
    data["routing/domain_shares"] = table
    wandb.log(data)
    wandb.finish()
