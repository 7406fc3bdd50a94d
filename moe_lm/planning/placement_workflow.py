"""The expert placement of `moe-lm estimate --placement`, from a routing trace to the engines' files: DeepSeek's EPLB
planned on half of each domain's documents and measured on the other half (placement.py), the all-to-all it gives on
the held-out tokens against experts laid out contiguously (comm_plan.py), and the files SGLang and vllm-ascend load.
`moe-lm estimate` (moe_lm/cli/estimate.py) checks the flags, prints the table and writes the files."""

from __future__ import annotations

import numpy as np

from moe_lm.config import Config
from moe_lm.planning.comm_plan import Layout, Links, slowest_rank_step
from moe_lm.planning.placement import (
    held_out_placement,
    held_out_rows,
    identity_placement,
    sglang_expert_location,
    vllm_expert_map,
)
from moe_lm.routing.trace import Trace


def plan_placement(trace: Trace, cfg: Config, layout: Layout, links: Links, redundant: int, dispatch_elem: int,
                   combine_elem: int) -> dict:  # fmt: skip
    """placement.json's content: EPLB of the trace's loads with `redundant` slots (a multiple of ep_size within the
    cap, checked by the caller) on the layout's EP ranks, every statistic planned on and held out (per domain too),
    and the all-to-all per GPU and step on the held-out tokens, each layer as long as its slowest rank, contiguous
    and placed; a ValueError or DataError naming what of the trace does not fit."""
    R, nodes = layout.ep_size, len(set(layout.ep_nodes()))
    result = held_out_placement(trace, R, nodes, cfg.model.moe.n_group, redundant)
    held = held_out_rows(np.asarray(trace.doc), np.asarray(trace.domain))
    placements = {"contiguous": identity_placement(len(trace.layers), trace.n_experts),
                  "placed": np.array(result["phy2log"])}  # fmt: skip
    a2a = {name: 1e3 * slowest_rank_step(trace, held, p, cfg, layout, links, dispatch_elem, combine_elem)
           for name, p in placements.items()}  # fmt: skip
    result["all_to_all_ms_per_step"] = {**a2a, "intra_gbs": links.intra_gbs, "inter_gbs": links.inter_gbs}
    return result


def engine_files(placement: dict, trace: Trace, n_layers: int, ranks: int) -> dict[str, dict]:
    """The files a placement is written as, by name: placement.json (all of it), SGLang's --init-expert-location
    file and vllm-ascend's expert map (the decoder's layers: SGLang's map has a row per decoder layer, and
    vllm-ascend places an MTP layer itself, eplb_utils.py `expert_file_to_tensor`); a ValueError for a placement an
    engine would misread (nothing is written then)."""
    phy2log = np.array(placement["phy2log"])
    decoder = [i for i, layer in enumerate(trace.layers) if layer < n_layers]
    sglang = sglang_expert_location(phy2log[decoder], [trace.layers[i] for i in decoder], n_layers)
    return {"placement.json": placement, "sglang_expert_location.json": sglang,
            "vllm_expert_map.json": vllm_expert_map(phy2log[decoder], ranks)}  # fmt: skip
