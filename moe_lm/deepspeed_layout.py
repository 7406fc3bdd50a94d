"""DeepSpeed's layouts on paper (nothing here imports DeepSpeed): how a pipeline numbers and cuts the model's layers,
which layers each rank of a staged run builds, and how DeepSpeed names each expert in a checkpoint. The runtime
(moe_lm/parallel/), the checkpoint reader (moe_lm/checkpoint/), the planner (moe_lm/planning/) and the training loop
read them here, one definition each.

The pipeline's layers (moe_lm/parallel/pipeline.py builds them; DeepSpeed cuts the list):
    layer 0          the token embedding
    layers 1..n      the decoder blocks (block i is layer i + 1)
    layer n + 1      the head: the final norm, the output head and the MTP modules
    (layer n + 2)    with MTP modules: the embedding again, tied, which they read

DeepSpeed cuts them by parameter count (`partition_method="parameters"`: each layer's trainable parameters as a
rank holds them, routed experts already split over ep_size) with its `partition_balanced`; `partition` here is the
same cut (tested equal to DeepSpeed's), so a stage builds its own layers only, and the planner's stages are the
engine's.

Checkpoint keys: DeepSpeed writes each *global* expert as `<moe>.deepspeed_moe.experts.deepspeed_experts.<e>.<param>`
(docs/deepspeed.md §4); our experts are stacked [E, ...] (`per_expert_keys` / `stacked_keys` convert), and a staged
checkpoint prefixes every key with its pipeline layer (`model_keys` reads it back as the plain model's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from moe_lm.config import Config
from moe_lm.errors import MissingKey
from moe_lm.model.params import stack_params

EMBED_LAYER = 0  # the embedding's pipeline layer


def block_layer(i: int) -> int:
    """The pipeline layer of decoder block i."""
    return i + 1


def head_layer(n_layers: int) -> int:
    """The pipeline layer of the head (final norm, output head, MTP modules)."""
    return n_layers + 1


def tied_embed_layer(n_layers: int) -> int:
    """The pipeline layer of the tied embedding the MTP modules read (only with MTP modules)."""
    return n_layers + 2


# ---- the cut -------------------------------------------------------------------------------------------------


def layer_params(cfg: Config) -> list[tuple[float, float, list[bool], bool]]:
    """Per pipeline layer: (parameters outside routed experts, routed experts' parameters, blocks, is the head)."""
    m = cfg.model
    D, e = m.dim, m.moe
    expert = 3 * D * e.moe_inter_dim
    embed = m.vocab_size * D
    layers: list[tuple[float, float, list[bool], bool]] = [(embed, 0, [], False)]
    for i in range(m.n_layers):
        moe = i >= m.first_k_dense_replace
        block = stack_params(dataclasses.replace(m, first_k_dense_replace=0 if moe else 1), 1)
        experts = e.n_routed_experts * expert if moe else 0
        layers.append((block - experts, experts, [moe], False))
    mtp_cfg = dataclasses.replace(m, first_k_dense_replace=0)
    module = 3 * D + 2 * D * D + stack_params(mtp_cfg, 1)  # enorm, hnorm, head norm, eh_proj, one MoE block
    mtp_experts = m.mtp.depth * e.n_routed_experts * expert
    head = D + embed + m.mtp.depth * module  # final norm, output head, MTP modules
    layers.append((head - mtp_experts, mtp_experts, [True] * m.mtp.depth, True))
    if m.mtp.depth:
        layers.append((embed, 0, [], False))  # the tied embedding the MTP modules read
    return layers


def partition(cfg: Config) -> list[int]:
    """The stages' layer bounds [0, b_1, ..., n]: DeepSpeed's cut over each layer's parameters as a rank holds them
    (its share of the routed experts)."""
    ep = cfg.parallel.ep_size
    return balanced_bounds(
        [int(other + experts / ep) for other, experts, _, _ in layer_params(cfg)], cfg.parallel.pp_size
    )


def balanced_bounds(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` (runtime/utils.py), which PipelineModule(partition_method="parameters")
    calls: of the cuts of `weights` into `parts` consecutive runs, the one whose heaviest and lightest runs differ
    least (its dynamic programme, ties to the latest cut; tested equal to DeepSpeed's). With no more layers than
    parts, one layer a stage (DeepSpeed's partition_uniform). why our own: the planner stays free of DeepSpeed."""
    n = len(weights)
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[i][j]: (cost = heaviest - lightest, heaviest, lightest, where the last run starts) for the first i
    # layers in j runs
    best = [[(inf, inf, inf, 0)] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                _, heavy, light, _ = best[k][j - 1]
                run = prefix[i] - prefix[k]
                heaviest, lightest = max(heavy, run), min(light, run)
                if best[i][j][0] >= heaviest - lightest:
                    best[i][j] = (heaviest - lightest, heaviest, lightest, k)
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]


def describe_layer(cfg: Config, index: int) -> str:
    """A pipeline layer's name, as the stage table prints it."""
    n = cfg.model.n_layers
    if index == EMBED_LAYER:
        return "embedding"
    if index < head_layer(n):
        return f"block {index - block_layer(0)}"
    return "head" if index == head_layer(n) else "embedding (tied)"


def describe_stages(cfg: Config, bounds: list[int]) -> str:
    """'stage 0: embedding .. block 2; stage 1: block 3 .. head' for the layer bounds [0, b_1, ..., n]. With
    DualPipeV (2 x pp_size slices), per rank: its slice r and the mirrored slice 2 pp_size - 1 - r."""

    def span(s: int) -> str:
        return f"{describe_layer(cfg, bounds[s])} .. {describe_layer(cfg, bounds[s + 1] - 1)}"

    slices = len(bounds) - 1
    if cfg.parallel.pp_schedule == "dualpipev":
        return "; ".join(f"rank {r}: {span(r)} + {span(slices - 1 - r)}" for r in range(slices // 2))
    return "; ".join(f"stage {s}: {span(s)}" for s in range(slices))


# ---- the stages a rank holds ---------------------------------------------------------------------------------


def stage_slices(cfg: Config, rank: int, world: int) -> tuple[list[int], list[int]]:
    """(the pipeline's layer bounds as DeepSpeed will cut them, the slices rank `rank` holds: its stage, and with
    DualPipeV the mirrored one too). The cut is the planner's (moe_lm/planning/stages.py), which is DeepSpeed's."""
    pp = cfg.parallel.pp_size
    stage = rank // (world // pp)  # the grid's order: pipe, then data
    if cfg.parallel.pp_schedule == "dualpipev":
        slices = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2 * pp))
        return partition(slices), [stage, 2 * pp - 1 - stage]
    return partition(cfg), [stage]


def stage_parts(cfg: Config, rank: int, world: int) -> Callable[[str], bool]:
    """Which of the model's parts (moe_lm/model/transformer.py: build_by_layer) rank `rank` builds: those of the
    pipeline layers its stage holds."""
    bounds, slices = stage_slices(cfg, rank, world)
    n = cfg.model.n_layers
    parts = set()
    for layer in (i for s in slices for i in range(bounds[s], bounds[s + 1])):
        if layer in (EMBED_LAYER, tied_embed_layer(n)):  # the embedding, or its tied copy on the head's stage
            parts.add("embed_tokens")
        elif layer == head_layer(n):
            parts |= {"head", *(f"mtp.{k}" for k in range(cfg.model.mtp.depth))}
        else:
            parts.add(f"layers.{layer - block_layer(0)}")
    return parts.__contains__


def stages_without_experts(cfg: Config, world: int) -> list[int]:
    """The pipeline stages that would hold no routed experts (only dense blocks, the embedding or the head).

    why they are refused: DeepSpeed's ZeRO optimizer reduces the gradient norm of each of its parameter groups over
    the pipeline group, and a stage without experts has no expert group: its ranks go on to the next collective
    while the others wait in that one, and the run hangs at its first step."""
    pp, m = cfg.parallel.pp_size, cfg.model
    moe_parts = [f"layers.{i}" for i in range(m.first_k_dense_replace, m.n_layers)] + [
        f"mtp.{k}" for k in range(m.mtp.depth)
    ]
    return [s for s in range(pp) if not any(map(stage_parts(cfg, s * (world // pp), world), moe_parts))]


# ---- checkpoint keys -----------------------------------------------------------------------------------------

STACKED = ("gate_up_proj", "down_proj")
DEEPSPEED_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*)deepspeed_moe\.experts\.deepspeed_experts\.(?P<e>\d+)\.(?P<name>\w+)$"
)


def per_expert_keys(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook: stacked `<prefix>deepspeed_moe.experts.<w>` [E, ...] -> one key per expert."""
    for name in STACKED:
        stacked = state_dict.pop(f"{prefix}deepspeed_moe.experts.{name}")
        for e, tensor in enumerate(stacked.unbind(0)):
            state_dict[f"{prefix}deepspeed_moe.experts.deepspeed_experts.{e}.{name}"] = tensor


def stacked_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Load pre-hook: the per-expert keys of `module.num_local_experts` experts -> the stacked tensors."""
    for name in STACKED:
        keys = [f"{prefix}deepspeed_moe.experts.deepspeed_experts.{e}.{name}" for e in range(module.num_local_experts)]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}deepspeed_moe.experts.{name}"] = torch.stack([state_dict.pop(k) for k in keys])


def plain_state_dict(sharded: dict[str, torch.Tensor], layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn per-global-expert keys (`...experts.deepspeed_moe.experts.deepspeed_experts.<e>.<w>`) into the plain
    model's stacked `...experts.<w>` tensors; `layout` is the plain model's state dict (for shapes)."""
    out, pieces = {}, {}
    for key, value in sharded.items():
        m = DEEPSPEED_EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            pieces.setdefault(m["prefix"] + m["name"], {})[int(m["e"])] = value
    for key, by_expert in pieces.items():
        expected = layout[key].shape[0]
        if sorted(by_expert) != list(range(expected)):
            raise MissingKey(f"checkpoint has experts {sorted(by_expert)} of {key}, expected 0..{expected - 1}")
        out[key] = torch.stack([by_expert[e] for e in range(expected)])
    return out


def model_keys(pipeline_state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A pipeline checkpoint's keys -> the plain model's (the pipeline layers above): the tied embedding
    `tied_modules.embed.embed_tokens.*`, block i at its pipeline layer (`<i+1>.block.*`), and the final norm, output
    head and MTP modules at the head's layer. Each key carries its global pipeline layer, so
    the stage-local numbering of the expert files does not enter."""
    head = f"{head_layer(n_layers)}."
    out = {}
    for key, value in pipeline_state.items():
        if key.startswith("tied_modules.embed.embed_tokens."):
            out[key.removeprefix("tied_modules.embed.")] = value
        elif key.startswith(head):
            out[key.removeprefix(head)] = value
        else:
            index, _, rest = key.partition(".")
            if not index.isdigit() or not rest.startswith("block."):
                raise MissingKey(f"a pipeline checkpoint key moe-lm does not write: {key}")
            out[f"layers.{int(index) - block_layer(0)}.{rest.removeprefix('block.')}"] = value
    return out
