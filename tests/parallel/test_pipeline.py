"""Pipeline parallelism on CPU with gloo (forked ranks): stages of DeepSpeed's pipeline engine give the single
process's training step by step (losses, balance losses, MTP losses, gradient norm, router biases, evaluation), their
checkpoints load as the plain model and export to HF with its logits, and they resume at another layout."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from moe_lm.checkpoint.format import latest_tag, load_model
from moe_lm.config import Config, ConfigError, dump_config
from moe_lm.deepspeed_layout import describe_stages, partition, stages_without_experts
from tests.helpers.runs import rows, tiny_train_cfg
from tests.workers.dist_reshard import fixed_tokens
from tests.workers.train_ranks import train_command

REL = 1e-5


def pipeline_cfg(tiny_data, out_dir, **settings) -> Config:
    """4 blocks (the first dense) and an MTP module, so that both stages hold MoE layers; ZeRO-1; each part of the
    model initialised from its own seed, as pipeline stages build theirs (train.layer_seeds)."""
    settings = {"max_steps": 4, "ckpt_interval": 4, "eval_interval": 2, "layer_seeds": True, **settings}
    cfg = tiny_train_cfg(tiny_data, out_dir, **settings)
    model = dataclasses.replace(cfg.model, n_layers=4, mtp=dataclasses.replace(cfg.model.mtp, depth=1))
    cfg = dataclasses.replace(cfg, model=model, parallel=dataclasses.replace(cfg.parallel, zero_stage=1))
    cfg.validate()
    return cfg


def with_out(cfg: Config, out_dir, **train) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out_dir), **train))


def same_rows(got: list[dict], want: list[dict], keys) -> None:
    """The two runs' rows agree on `keys` (rel 1e-5), step by step."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in keys:
            assert g[key] == pytest.approx(w[key], rel=REL, abs=1e-9), (g["step"], key, g[key], w[key])


def _exact_keys(row: dict) -> set[str]:
    prefixes = ("loss", "aux_loss", "mtp_loss/", "grad_norm", "bias_", "maxvio", "domain_jsd/", "same_first/",
                "topk_overlap/", "ppl")  # fmt: skip
    return {k for k in row if k.startswith(prefixes)}


def check_same_run(got, want) -> None:
    """Train and eval rows of two runs: every loss, balance loss, gradient norm, bias and routing number equal."""
    for kind in ("train", "eval"):
        g, w = rows(got, kind), rows(want, kind)
        keys = sorted(_exact_keys(w[0]))
        assert keys and set(keys) <= set(g[0]), set(keys) - set(g[0])
        same_rows(g, w, keys)


@pytest.fixture
def single_process(tiny_data, tmp_path, train):
    """The reference: one process, the same global batch (micro 4 x 4 micro-batches)."""
    cfg = pipeline_cfg(tiny_data, tmp_path / "one", grad_accum_steps=4)
    train(cfg)
    return cfg


def test_pp2_equals_single_process_and_checkpoint_loads_and_exports(single_process, tmp_path, ranks, train, cli):
    """PP 2 on 2 ranks (embedding and blocks on stage 0, blocks, head and the MTP module on stage 1: the balance
    losses cross the stage boundary, the embedding is tied across it) trains as the single process does, step by
    step; its checkpoint, written per stage, loads as the same plain model and exports to HF with its logits."""
    pp2 = with_out(single_process, tmp_path / "pp2")
    dump_config(pp2, tmp_path / "pp2.yaml")
    out = ranks(train_command, 2, "--config", tmp_path / "pp2.yaml", "parallel.pp_size=2")[0]
    assert "world 2 (pipeline 2 stages x 1 data-parallel)" in out
    # the engine cut the layers where the planner (moe-lm estimate) says it does
    planned = dataclasses.replace(pp2, parallel=dataclasses.replace(pp2.parallel, pp_size=2))
    assert f"pipeline (1f1b): {describe_stages(planned, partition(planned))} (cut by parameters)" in out
    assert "block 3 .. head" in out or "block 3 .. embedding (tied)" in out  # a block on each stage
    check_same_run(tmp_path / "pp2", tmp_path / "one")
    assert latest_tag(tmp_path / "pp2") == "step_00000004"
    _, want, _ = load_model(tmp_path / "one")
    _, got, _ = load_model(tmp_path / "pp2")  # from the stages' files
    assert got.state_dict().keys() == want.state_dict().keys()
    for key, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
    import transformers

    assert cli("export", "--run", tmp_path / "pp2", "--out", tmp_path / "hf").returncode == 0  # the command, as users
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = fixed_tokens(want.cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, want(tokens).logits, atol=1e-4, rtol=1e-4)

    # resuming at the same layout restores DeepSpeed's stage files (optimizer included): steps 5-6 as the single
    # process continues; at another layout (PP 2 -> 1 and 1 -> 2) the weights with a fresh optimizer, both ways alike
    for name in ("pp2_again", "pp2_to_1", "one_to_2"):
        shutil.copytree(tmp_path / ("one" if name == "one_to_2" else "pp2"), tmp_path / name)
    train_more = dict(max_steps=6)
    dump_config(with_out(pp2, tmp_path / "pp2_again", **train_more), tmp_path / "again.yaml")
    ranks(train_command, 2, "--config", tmp_path / "again.yaml", "parallel.pp_size=2")
    dump_config(with_out(pp2, tmp_path / "one_to_2", **train_more), tmp_path / "one_to_2.yaml")
    ranks(train_command, 2, "--config", tmp_path / "one_to_2.yaml", "parallel.pp_size=2")
    train(with_out(single_process, tmp_path / "one", **train_more))
    train(with_out(single_process, tmp_path / "pp2_to_1", **train_more))
    later = lambda run: [r for r in rows(run) if r["step"] > 4]  # noqa: E731
    keys = ["loss", "aux_loss", "mtp_loss/depth_1", "grad_norm"]
    same_rows(later(tmp_path / "pp2_again"), later(tmp_path / "one"), keys)
    same_rows(later(tmp_path / "pp2_to_1"), later(tmp_path / "one_to_2"), keys)
    # the fresh optimizer state makes them another trajectory than the exact resume's
    assert later(tmp_path / "pp2_to_1")[-1]["loss"] != pytest.approx(later(tmp_path / "one")[-1]["loss"], rel=REL)


@pytest.mark.parametrize("world", [4, 8])
def test_pp2_with_expert_parallel_inside_stages(single_process, tmp_path, ranks, world):
    """PP 2 x DP 2 on 4 ranks with EP 2 inside each stage (ranks 0-1 and 2-3), and PP 2 x DP 4 on 8 ranks (two
    expert-data-parallel replicas of each EP group inside a stage), with full activation checkpointing: the
    all-to-all and the experts' gradient reduction stay within a stage, and the run equals the single process
    (same global batch; recomputation changes no number)."""
    dp = world // 2
    cfg = with_out(single_process, tmp_path / "pp2ep2", grad_accum_steps=4 // dp)
    dump_config(cfg, tmp_path / "pp2ep2.yaml")
    argv = ("--config", tmp_path / "pp2ep2.yaml", "parallel.pp_size=2", "parallel.ep_size=2",
            "performance.activation_checkpointing=full")  # fmt: skip
    out = ranks(train_command, world, *argv)[0]
    assert f"world {world} (pipeline 2 stages x {dp} data-parallel)" in out
    planned = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2, ep_size=2))
    assert f"pipeline (1f1b): {describe_stages(planned, partition(planned))} (cut by parameters)" in out
    check_same_run(tmp_path / "pp2ep2", tmp_path / "one")
    assert all(r["a2a_bytes_per_rank"] > 0 for r in rows(tmp_path / "pp2ep2"))
    _, want, _ = load_model(tmp_path / "one")
    _, got, _ = load_model(tmp_path / "pp2ep2")  # experts from both stages' EP ranks
    for key, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_pp2_in_bf16_follows_the_single_process(tiny_data, tmp_path, train, ranks):
    """bf16 (what a GPU run uses: bf16 weights, ZeRO-1's fp32 master weights): PP 2 follows the single process's
    bf16 run; not bit for bit, since the stages reduce their bf16 gradients in another order (measured: the loss
    within 1e-5 and the gradient norm within 7e-5, relative, over 4 steps)."""
    cfg = pipeline_cfg(tiny_data, tmp_path / "one", grad_accum_steps=4, eval_interval=4)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dtype="bf16"))
    train(cfg)
    dump_config(with_out(cfg, tmp_path / "pp2"), tmp_path / "pp2.yaml")
    ranks(train_command, 2, "--config", tmp_path / "pp2.yaml", "parallel.pp_size=2")
    got, want = rows(tmp_path / "pp2"), rows(tmp_path / "one")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4) and g["grad_norm"] == pytest.approx(
            w["grad_norm"], rel=1e-3
        )
    assert rows(tmp_path / "pp2", "eval")[-1]["loss"] == pytest.approx(
        rows(tmp_path / "one", "eval")[-1]["loss"], rel=1e-4
    )


def test_dualpipev_equals_single_process(single_process, tmp_path, ranks, train):
    """parallel.pp_schedule=dualpipev (DeepSpeed's DualPipeV: rank 0 holds the first and the last slice, rank 1 the
    two middle ones; 4 micro-batches = 2 x pp) trains and evaluates as the single process, and its checkpoint loads
    as the same model and resumes exactly."""
    cfg = with_out(single_process, tmp_path / "dpv")
    dump_config(cfg, tmp_path / "dpv.yaml")
    argv = ("parallel.pp_size=2", "parallel.pp_schedule=dualpipev")
    out = ranks(train_command, 2, "--config", tmp_path / "dpv.yaml", *argv)[0]
    planned = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2, pp_schedule="dualpipev"))
    bounds = partition(dataclasses.replace(planned, parallel=dataclasses.replace(planned.parallel, pp_size=4)))
    assert f"pipeline (dualpipev): {describe_stages(planned, bounds)} (cut by parameters)" in out
    check_same_run(tmp_path / "dpv", tmp_path / "one")
    _, want, _ = load_model(tmp_path / "one")
    _, got, _ = load_model(tmp_path / "dpv")
    for key, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
    dump_config(with_out(cfg, tmp_path / "dpv", max_steps=6), tmp_path / "more.yaml")
    ranks(train_command, 2, "--config", tmp_path / "more.yaml", *argv)
    train(with_out(single_process, tmp_path / "one", max_steps=6))
    later = lambda run: [r for r in rows(run) if r["step"] > 4]  # noqa: E731
    same_rows(later(tmp_path / "dpv"), later(tmp_path / "one"), ["loss", "aux_loss", "mtp_loss/depth_1", "grad_norm"])


def test_two_node_job_with_a_stage_on_each_node(single_process, tmp_path, launcher):
    """`launch/train.py` as a 2-node job (two launchers on loopback hosts, one rank each) with PP 2: stage 0 on node
    0, stage 1 on node 1, the activations and gradients crossing the nodes; the single process's run."""
    cfg = with_out(single_process, tmp_path / "nodes")
    dump_config(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2)), tmp_path / "n.yaml")
    out = launcher.launch("launch/train.py", "--config", str(tmp_path / "n.yaml"), n=1, nodes=2).stdout
    assert "world 2 (pipeline 2 stages x 1 data-parallel)" in out
    check_same_run(tmp_path / "nodes", tmp_path / "one")


def test_pipeline_layout_refusals(tiny_data, tmp_path, train):
    """ZeRO-2 with stages is refused naming ZeRO-1 (DeepSpeed's pipeline engine refuses it, with an assertion);
    a pp_size that does not divide the world, and objectives the stages cannot carry, are refused in one line."""
    cfg = pipeline_cfg(tiny_data, tmp_path / "run")
    zero2 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=2, pp_size=2))
    refused = r"parallel.zero_stage = 2 with parallel.pp_size=2: .* set parallel.zero_stage=1"
    with pytest.raises(ConfigError, match=refused):
        zero2.validate()
    pp2 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2))
    with pytest.raises(ConfigError, match=r"parallel.pp_size = 2 must divide the world size \(1\)"):
        train(pp2)
    prefix = dataclasses.replace(pp2, objective=dataclasses.replace(pp2.objective, name="prefix_lm", prefix_len=4))
    with pytest.raises(ConfigError, match="trains objective.name=lm only"):
        prefix.validate()


def test_a_stage_builds_its_own_layers_only(tiny_data, tmp_path):
    """Each rank of PP 2 (and of DualPipeV) builds the parameters of the layers its stage holds, as the planner
    counts them, and of the other layers only their routers (on the meta device otherwise)."""
    from moe_lm.deepspeed_layout import layer_params, stage_parts, stage_slices
    from moe_lm.model import build_by_layer

    cfg = pipeline_cfg(tiny_data, tmp_path / "run")
    m = cfg.model
    router = m.moe.n_routed_experts * m.dim
    moe_blocks = m.n_layers - m.first_k_dense_replace + m.mtp.depth
    for schedule in ("1f1b", "dualpipev"):
        staged = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2, pp_schedule=schedule))
        layers = layer_params(staged)
        for rank in range(2):
            model = build_by_layer(m, cfg.seed, stage_parts(staged, rank, 2))
            built = sum(p.numel() for p in model.parameters() if not p.is_meta)
            bounds, slices = stage_slices(staged, rank, 2)
            held = {i for s in slices for i in range(bounds[s], bounds[s + 1])}
            if {0, len(layers) - 1} <= held:  # both ends on one rank (DualPipeV's rank 0): one embedding
                held.discard(len(layers) - 1)
            stage = sum(other + experts for i, (other, experts, _, _) in enumerate(layers) if i in held)
            own_routers = sum(moe for i in held for moe in layers[i][2]) * router
            assert built == stage + (moe_blocks * router - own_routers), (schedule, rank)


def test_a_stage_without_routed_experts_is_refused_before_it_hangs(tiny_data, tmp_path, ranks):
    """2 blocks, the first dense: stage 0 would hold the embedding and a dense block only. DeepSpeed's ZeRO
    optimizer would then reduce one gradient-norm group fewer on it than on stage 1, and both ranks would wait."""
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=1))
    staged = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2))
    assert stages_without_experts(staged, world=2) == [0]
    four = pipeline_cfg(tiny_data, tmp_path / "four")
    assert (
        stages_without_experts(dataclasses.replace(four, parallel=dataclasses.replace(four.parallel, pp_size=2)), 2)
        == []
    )
    dump_config(cfg, tmp_path / "two_blocks.yaml")
    with pytest.raises(AssertionError, match="stage 0 would hold no routed experts"):
        ranks(train_command, 2, "--config", tmp_path / "two_blocks.yaml", "parallel.pp_size=2", timeout=180)
    assert not (tmp_path / "run").exists()
