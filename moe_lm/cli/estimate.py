"""Plan a training layout on paper: memory per GPU, and what expert parallelism sends within and across nodes.

    moe-lm estimate --config gpu_1b
    moe-lm estimate --config deepseek_v3_16b --nodes 2 --gpus-per-node 8 parallel.ep_size=16
    moe-lm estimate --config deepseek_v3_671b --nodes 8 --gpus-per-node 8 --intra-gbs 160 --inter-gbs 50
    moe-lm estimate --config deepseek_v3_671b --nodes 32 --gpus-per-node 8 parallel.pp_size=4 \
        performance.activation_checkpointing=full train.grad_accum_steps=16
    moe-lm estimate --config tiny --gpus-per-node 2 parallel.ep_size=2 --trace analysis/tiny/trace
    moe-lm estimate --config tiny --gpus-per-node 4 parallel.ep_size=4 --trace analysis/tiny/trace --placement place

Memory (moe_lm/planning/memory.py): ZeRO's mixed-precision bytes per parameter, experts split by ep_size,
activations counted per token and block from the model's own tensors; with pipeline stages (parallel.pp_size) a
row per stage (its layers, the micro-batches 1F1B keeps in flight, its memory with and without recompute) and the
bubble; compare it with a measured peak (peak_mem_gib in every train row on CUDA). Communication
(moe_lm/planning/comm_plan.py): the dispatcher's bytes per GPU and step, within the node and across nodes,
expected under uniform routing with and without the group limit (and for a recorded routing trace), the time they
take at the given bandwidths, the compute time at the given MFU, and their ratio: how much of the all-to-all must
hide behind compute. With --placement (moe_lm/planning/placement_workflow.py): DeepSeek's EPLB of the trace's
expert loads, planned on half of each domain's documents and measured on the other half, per domain too (vLLM's
balancedness over ranks, Megatron-Core's overload factor, the ranks' coefficient of variation, against experts laid
out contiguously), written as SGLang's --init-expert-location file and vLLM's expert map. The same as
`python launch/estimate_memory.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from moe_lm.cli import main_of
from moe_lm.cli.options import add_config, load
from moe_lm.errors import ConfigError, DataError, UserError
from moe_lm.output_folder import OutputFolder


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_config(ap)
    ap.add_argument("--nodes", type=int, default=1, help="machines in the job")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per machine (default: --world / --nodes)")
    ap.add_argument("--world", type=int, default=None, help="GPUs in all (default: nodes x GPUs per node, or 1)")
    ap.add_argument("--intra-gbs", type=float, default=450.0, help="GB/s per GPU inside a node (H100 NVLink)")
    ap.add_argument("--inter-gbs", type=float, default=50.0, help="GB/s per GPU across nodes (one 400 Gb/s NIC)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H100)")
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation the compute time assumes")
    ap.add_argument("--dispatch-bytes", type=int, default=None,
                    help="bytes per element of dispatched rows (default: the training dtype's; 1 for FP8)")  # fmt: skip
    ap.add_argument("--trace", default=None, help="a routing trace folder (moe-lm analyze): plan for its routing")
    ap.add_argument("--redundant", type=int, default=None,
                    help="extra expert slots for the placement from --trace (default: one per EP rank)")  # fmt: skip
    ap.add_argument("--placement", metavar="DIR", default=None,
                    help="with --trace: DeepSeek's EPLB of the trace, planned on half its documents and measured on "
                    "the other half, written into DIR as SGLang's --init-expert-location file and vLLM's expert "
                    "map")  # fmt: skip
    ap.add_argument("--force", action="store_true",
                    help="write --placement even if it holds files estimate did not write: that folder is moved "
                    "aside to DIR.prev-<time> (nothing is deleted)")  # fmt: skip


def layout_of(args, ep_size: int, pp_size: int = 1):
    from moe_lm.planning.comm_plan import Layout

    nodes, gpn, world = args.nodes, args.gpus_per_node, args.world
    if nodes < 1 or (gpn is not None and gpn < 1) or (world is not None and world < 1):
        raise UserError("--nodes, --gpus-per-node and --world must be >= 1")
    if gpn is None:
        world = world or nodes
        if world % nodes:
            raise UserError(f"--world {world} is not a multiple of --nodes {nodes}")
        gpn = world // nodes
    if world is not None and world != nodes * gpn:
        raise UserError(f"--world {world} != --nodes {nodes} x --gpus-per-node {gpn}")
    return Layout(nodes, gpn, ep_size, pp_size)


def run(args: argparse.Namespace) -> None:
    cfg = load(args)
    if cfg.parallel.pp_schedule != "1f1b":
        raise UserError(
            f"the planner plans 1F1B stages; parallel.pp_schedule={cfg.parallel.pp_schedule} is not planned (each "
            "rank holds two slices and keeps another set of micro-batches): plan with parallel.pp_schedule=1f1b"
        )
    layout = layout_of(args, cfg.parallel.ep_size, cfg.parallel.pp_size)
    try:
        layout.check(cfg.model.moe.n_routed_experts)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.trace and cfg.parallel.ep_size == 1:
        # why refused, not ignored: the trace plans the all-to-all, and with one EP rank there is none
        read_trace(args.trace)
        raise UserError(f"--trace {args.trace} plans the expert-parallel all-to-all, and with parallel.ep_size 1 there "
                        "is none: give parallel.ep_size=N (with --gpus-per-node or --world)")  # fmt: skip
    if args.placement and not args.trace:
        raise UserError("--placement plans from a routing trace: give --trace TRACE (moe-lm analyze's trace/)")
    out = OutputFolder(args.placement, "estimate", args.force, flag="--placement") if args.placement else None
    if out is not None:
        check_moe_layers(read_trace(args.trace), cfg)
    if args.redundant is None:  # one extra slot per EP rank, for the plan of the trace and the placement alike
        args.redundant = layout.ep_size
    if args.trace:
        args.redundant = redundant_slots(args.redundant, cfg, layout)
    print_memory(args.config, cfg, layout.world)
    if cfg.parallel.ep_size > 1:
        print_communication(args, cfg, layout)
    if out is not None:
        write_placement(out, read_trace(args.trace), cfg, layout, args)


def redundant_slots(redundant: int, cfg, layout) -> int:
    """--redundant checked: >= 0 and a multiple of ep_size (every rank holds as many slots), and capped, with a line
    saying so, where more slots would put two copies of an expert on one rank (moe_lm/planning/placement.py: the
    rank would hold the same weights twice, and vllm-ascend's loader misreads it). why a cap and not a refusal: the
    cap is the placement asked for at its fullest, every rank holding every expert it can (of its node, under the
    hierarchical policy)."""
    from moe_lm.planning.placement import most_slots, policy

    R, E, G = layout.ep_size, cfg.model.moe.n_routed_experts, cfg.model.moe.n_group
    if redundant < 0:
        raise UserError(f"--redundant {redundant}: must be >= 0 (slots beside one for each expert)")
    if redundant % R:
        raise UserError(f"--redundant {redundant}: must be a multiple of ep_size ({R}): every rank holds as many slots")
    nodes = len(set(layout.ep_nodes()))
    most = most_slots(E, G, nodes, R) - E
    if redundant > most:
        pool = " of its node" if policy(G, nodes)[1] > 1 else ""
        print(f"--redundant {redundant}: at most {most} redundant slots keep every copy of an expert on a rank of its "
              f"own ({E} experts on {R} EP ranks over {nodes} node(s), every rank holding every expert{pool}); "
              f"placing {most}")  # fmt: skip
        return most
    return redundant


def check_moe_layers(trace, cfg) -> None:
    """Refuse a trace whose MoE layers are not the config's (the decoder's from first_k_dense_replace on, then the
    MTP modules' n_layers + k): the engines' files give each of the config's layers its row."""
    m = cfg.model
    if m.arch != "decoder":
        raise UserError(f"--placement writes the engines' files of a decoder-only model; model.arch={m.arch} has no "
                        "such layout: plan without --placement")  # fmt: skip
    expected = list(range(min(m.first_k_dense_replace, m.n_layers), m.n_layers))
    expected += [m.n_layers + k for k in range(m.mtp.depth)]
    if list(trace.layers) != expected:
        raise UserError(f"the trace {trace.folder} records MoE layers {trace.layers} but the config's MoE layers are "
                        f"{expected}: plan with the config of the model that recorded it (model.n_layers, "
                        "model.first_k_dense_replace, model.mtp.depth)")  # fmt: skip


def links_and_bytes(args, cfg):
    """The GPUs' links and compute rate, and the bytes of a dispatched and a combined element."""
    from moe_lm.planning.comm_plan import Links

    links = Links(args.intra_gbs, args.inter_gbs, args.peak_tflops, args.mfu)
    elem = 4 if cfg.parallel.dtype == "fp32" else 2
    return links, args.dispatch_bytes or elem, elem


def write_placement(out, trace, cfg, layout, args) -> None:
    """EPLB from the trace (planned on half of each domain's documents, measured on the others; moe_lm/planning/
    placement_workflow.py), its statistics and the all-to-all time it gives printed, and the engines' placement
    files written into `out`."""
    from moe_lm.planning.placement_workflow import engine_files, plan_placement

    links, out_elem, elem = links_and_bytes(args, cfg)
    try:  # `args.redundant` is a multiple of ep_size and within the cap: redundant_slots checked it
        placement = plan_placement(trace, cfg, layout, links, args.redundant, out_elem, elem)
    except (ValueError, DataError) as e:
        raise UserError(f"--trace {trace.folder}: {e}") from None
    try:
        files = engine_files(placement, trace, cfg.model.n_layers, layout.ep_size)
    except ValueError as e:  # why kept: a file an engine misreads is refused, not written (nothing is written)
        raise UserError(f"--placement {out.path}: {e}") from None
    print_placement(placement, trace, cfg, layout)
    with out.staged() as folder:
        for name, content in files.items():
            (folder / name).write_text(json.dumps(content) + "\n")
    print(f"wrote {', '.join(files)} to {out.path}")


def print_placement(placement: dict, trace, cfg, layout) -> None:
    """The placement's statistics, contiguous -> placed, planned on, held out and per held-out domain, and the
    all-to-all it gives."""
    nodes = len(set(layout.ep_nodes()))
    print(f"placement (DeepSeek's EPLB, {trace.n_experts} experts + {placement['redundant']} redundant slots on "
          f"{layout.ep_size} EP ranks over {nodes} node(s), {cfg.model.moe.n_group} group(s)): planned on half of each "
          "domain's documents, measured on the other half; contiguous -> placed")  # fmt: skip
    print(f"  {'tokens':24s} {'balancedness':>16s} {'overload mean':>16s} {'overload max':>16s} {'rank CV':>16s}")
    rows = [("planned on", placement["planned_on"]), ("held out", placement["held_out"])]
    rows += [(f"  held out, {d}", r) for d, r in placement["held_out_by_domain"].items()]
    for name, r in rows:
        cells = [f"{r['contiguous'][key]:.3f} -> {r['placed'][key]:.3f}" for key in
                 ("balancedness", "overload_factor_mean", "overload_factor_max", "rank_cv")]  # fmt: skip
        print(f"  {name:24s} " + " ".join(f"{c:>16s}" for c in cells))
    a2a = placement["all_to_all_ms_per_step"]
    ratio = a2a["placed"] / a2a["contiguous"] if a2a["contiguous"] > 0 else float("nan")
    print(f"  all-to-all per GPU and step on the held-out tokens, each layer as long as its slowest rank: contiguous "
          f"{a2a['contiguous']:.3g} ms -> placed {a2a['placed']:.3g} ms ({ratio:.2f}x)")  # fmt: skip


def read_trace(folder: str):
    """The routing trace at `folder` (moe-lm analyze's trace/), or a UserError naming what is wrong with it."""
    from moe_lm.routing.trace import Trace

    try:
        trace = Trace(folder)
    except DataError as e:
        raise UserError(str(e)) from None
    if not trace.layers:
        raise UserError(f"the trace {folder} records no MoE layer: plan with a trace of an MoE model (moe-lm analyze)")
    return trace


def print_memory(name: str, cfg, world: int) -> None:
    from moe_lm.model import count_params
    from moe_lm.planning.memory import GB, stage_estimates

    n, t, p = count_params(cfg.model), cfg.train, cfg.parallel
    estimates = stage_estimates(cfg, world)
    worst = max(range(len(estimates)), key=lambda s: estimates[s].total)
    m = estimates[worst]
    recompute = cfg.performance.activation_checkpointing
    where = f" = pipeline {p.pp_size} stages x {world // p.pp_size} data-parallel" if p.pp_size > 1 else ""
    print(
        f"{name}: {n.total / 1e9:.3f} B parameters ({n.active / 1e9:.3f} B active)"
        + (f" + MTP {n.mtp_total / 1e9:.3f} B" if n.mtp_total else "")
        + f"; bf16 training, world {world}{where}, ZeRO-{p.zero_stage if world > 1 else 1}, ep_size {p.ep_size}, "
        f"micro-batch {t.micro_batch_size} x {t.seq_len}, activation checkpointing {recompute}"
    )
    for part in ("weights", "gradients", "optimizer", "activations", "logits", "buckets"):
        print(f"  {part:12s} {getattr(m, part) / GB:8.2f} GiB")
    largest = f" (stage {worst}, the largest)" if p.pp_size > 1 else ""
    print(f"  {'total':12s} {m.total / GB:8.2f} GiB per GPU{largest}")
    if p.pp_size > 1:
        print_stages(cfg, world, estimates)


def print_stages(cfg, world: int, estimates) -> None:
    from moe_lm.deepspeed_layout import describe_layer
    from moe_lm.planning.memory import GB, stage_estimates
    from moe_lm.planning.stages import bubble, stages

    p, m = cfg.parallel, cfg.train.grad_accum_steps
    none, full = (stage_estimates(cfg, world, mode) for mode in ("none", "full"))
    print(
        f"pipeline: {p.pp_size} stages, 1F1B over {m} micro-batches (train.grad_accum_steps): bubble "
        f"{bubble(p.pp_size, m):.1%} of a step; stages cut by parameters as DeepSpeed cuts them"
    )
    print(f"  {'stage':5s} {'layers':30s} {'params/GPU':>10s} {'in flight':>9s} {'activations':>11s} {'total':>9s} "
          f"{'no recompute':>12s} {'full recompute':>14s}")  # fmt: skip
    for s, (stage, e) in enumerate(zip(stages(cfg), estimates, strict=True)):
        layers = f"{describe_layer(cfg, stage.start)} .. {describe_layer(cfg, stage.stop - 1)}"
        params = stage.other_params + stage.expert_params / p.ep_size
        print(
            f"  {s:5d} {layers:30s} {params / 1e9:9.2f}B {stage.in_flight:9d} {e.activations / GB:7.2f} GiB "
            f"{e.total / GB:5.2f} GiB {none[s].total / GB:8.2f} GiB {full[s].total / GB:10.2f} GiB"
        )


def print_communication(args, cfg, layout) -> None:
    from moe_lm.model import train_flops_per_token
    from moe_lm.planning.comm_plan import trace_plan, uniform_step

    links, out_elem, elem = links_and_bytes(args, cfg)
    steps = [uniform_step(cfg, layout, limited=False, dispatch_elem=out_elem, combine_elem=elem)]
    if cfg.model.moe.n_group > 1:
        steps.append(uniform_step(cfg, layout, limited=True, dispatch_elem=out_elem, combine_elem=elem))
    load = None
    if args.trace:
        try:
            step, load = trace_plan(read_trace(args.trace), cfg, layout, args.redundant, out_elem, elem)
        except (DataError, ConfigError) as e:  # a trace or a layout the user gave
            raise UserError(str(e)) from None
        steps.append(step)
    t, m = cfg.train, cfg.model
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps
    # with pipeline stages a GPU computes its stage's share of the layers: the model's FLOPs / pp_size
    flops = train_flops_per_token(m, t.seq_len) * tokens / cfg.parallel.pp_size
    compute = flops / (links.peak_tflops * 1e12 * links.mfu)
    print(
        f"expert-parallel all-to-all per GPU and step ({layout.nodes} node(s) x {layout.gpus_per_node} GPUs, "
        f"EP {layout.ep_size} over {len(set(layout.ep_nodes()))} node(s); {tokens} tokens, forward + backward"
        f"{' + recompute' if cfg.performance.activation_checkpointing != 'none' else ''}; "
        f"{links.intra_gbs:g} GB/s in a node, {links.inter_gbs:g} GB/s across):"
    )
    print(f"  {'routing':34s} {'pairs/token self+intra+inter':>29s} {'nodes/token':>12s} {'remote':>6s} "
          f"{'dispatch in/out GB':>19s} {'combine in/out GB':>18s} {'a2a ms':>8s} {'a2a/compute':>11s}")  # fmt: skip
    for s in steps:
        p = s.pairs
        print(
            f"  {s.label:34s} {p['self']:9.2f} +{p['intra']:6.2f} +{p['inter']:6.2f}  "
            f"{s.nodes_per_token:6.2f} ({s.max_nodes}) {s.remote_nodes:6.2f} "
            f"{s.dispatch['intra'] / 1e9:9.2f}/{s.dispatch['inter'] / 1e9:<9.2f}"
            f"{s.combine['intra'] / 1e9:8.2f}/{s.combine['inter'] / 1e9:<9.2f}"
            f"{s.seconds(links) * 1e3:8.1f} {s.seconds(links) / compute:11.2f}"
        )
    print(
        "  pairs: a token's trips to distinct ranks (to its own, same node, other nodes); nodes/token: expected (most);"
        "\n  remote: other nodes reached, the cross-node rows of a dispatcher that crosses once per node (DeepEP)"
    )
    print(
        f"  compute: {train_flops_per_token(m, t.seq_len) / 1e9:.2f} GFLOP per token x {tokens} tokens"
        + (f" / {cfg.parallel.pp_size} stages" if cfg.parallel.pp_size > 1 else "")
        + f" at {links.mfu:.0%} of {links.peak_tflops:g} TFLOP/s = {compute * 1e3:.1f} ms"
    )
    if load is not None:
        print(
            f"  expert load of the trace, max / mean over the {layout.ep_size} EP ranks (mean over layers, worst): "
            f"contiguous {sum(load.contiguous) / len(load.contiguous):.2f}, {max(load.contiguous):.2f}; "
            f"placed with {load.redundant} redundant slots (EPLB) "
            f"{sum(load.placed) / len(load.placed):.2f}, {max(load.placed):.2f}"
        )


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.estimate")
