"""Training in-process (one DeepSpeed rank, gloo): run folder, metrics, resume exactness, crash-safe saves, NaNs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moe_lm.checkpoint import save_resume
from moe_lm.checkpoint.format import COMPLETE, latest_tag
from moe_lm.config import MTPConfig, dump_config, load_config
from moe_lm.train import objective
from moe_lm.train.schedule import lr_at
from tests.helpers.runs import rows, tiny_train_cfg, with_train

ROOT = Path(__file__).resolve().parents[2]


def test_run_folder_holds_config_metrics_and_checkpoints(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run")
    final = train(cfg)
    run = tmp_path / "run"
    assert load_config(run / "config.yaml") == cfg
    train_rows = rows(run)
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    for r in train_rows:
        assert {"loss", "lr", "tokens_per_s", "grad_norm", "mfu", "maxvio/layer_1", "bias_std/layer_1"} <= set(r)
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.optim, cfg.train.max_steps))
    evals = rows(run, "eval")
    assert [r["step"] for r in evals] == [3, 6]
    assert set(final) >= {"loss", "ppl", "loss/astronomy", "loss/cooking", "loss/finance", "maxvio_global/layer_1"}
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    # checkpoints every 3 steps and at the last one; the pointer names the newest complete one
    assert latest_tag(run) == "step_00000006"
    assert (run / "checkpoints" / "step_00000006" / COMPLETE).is_file()
    # the bias update ran: biases moved from zero
    assert abs(train_rows[-1]["bias_std/layer_1"]) > 0


def test_resume_reproduces_the_uninterrupted_run(tiny_data, tmp_path, train, trained_run):
    straight = trained_run(max_steps=8, ckpt_interval=100)  # the uninterrupted reference, shared
    cfg = tiny_train_cfg(tiny_data, tmp_path / "straight", max_steps=8, ckpt_interval=100)
    interrupted = with_train(cfg, out_dir=str(tmp_path / "resumed"), stop_at=4)
    train(interrupted)
    assert latest_tag(tmp_path / "resumed") == "step_00000004"
    train(with_train(interrupted, stop_at=0))  # same command again: resumes from step 4
    a, b = rows(straight), rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 9))  # no duplicated rows after the resume
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=0), (ra["step"], ra["loss"], rb["loss"])
        assert ra["bias_mean/layer_1"] == pytest.approx(rb["bias_mean/layer_1"], rel=1e-6, abs=1e-9)
    # the measured training time goes on from the checkpoint's (each step's own time, summed), never restarts
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.train.seq_len
    seconds = [0.0] + [r["train_seconds"] for r in b]
    for step, r in enumerate(b):  # each row adds its own step's time (tokens / tokens_per_s), across the resume too
        assert seconds[step + 1] - seconds[step] == pytest.approx(tokens / r["tokens_per_s"], rel=1e-6)


def test_mtp_training_logs_every_depth_and_resumes_exactly(tiny_data, tmp_path, train, capsys):
    """With model.mtp.depth = 2: per-depth MTP losses in the train and eval rows (and on the console), eval's `loss`
    is the main head's, the MTP routers are balanced and logged, and resuming reproduces the run."""
    cfg = tiny_train_cfg(tiny_data, tmp_path / "straight", max_steps=8, ckpt_interval=100, eval_interval=4)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp=MTPConfig(depth=2, late_start=0.5)))
    train(cfg)
    out = capsys.readouterr().out
    assert "| mtp1 " in out
    mla = cfg.model.mla  # the run's log says which fused kernel runs its attention (on the CPU: padded flash)
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    assert f"attention: FlashAttention (q/k heads {qk}, v padded from {mla.v_head_dim} to {qk})" in out
    interrupted = with_train(cfg, out_dir=str(tmp_path / "resumed"), stop_at=4)
    train(interrupted)
    train(with_train(interrupted, stop_at=0))
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 9))
    keys = ("loss", "mtp_loss/depth_1", "mtp_loss/depth_2", "bias_mean/layer_2", "bias_mean/layer_3")
    for ra, rb in zip(a, b, strict=True):
        for key in keys:  # layers 2 and 3 are the MTP blocks (n_layers = 2)
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key, ra[key], rb[key])
    assert [r["mtp_weight"] for r in a] == [0.3] * 4 + [0.1] * 4  # the schedule switched at half the run
    assert a[-1]["mtp_loss/depth_1"] < a[0]["mtp_loss/depth_1"]
    evals = rows(tmp_path / "straight", "eval")
    assert {"mtp_loss/depth_1", "mtp_loss/depth_2", "maxvio_global/layer_3", "domain_jsd/layer_3"} <= set(evals[-1])
    # eval's `loss` is the main head's alone: recomputed here on the same windows from the final checkpoint
    from moe_lm.checkpoint.format import load_model
    from moe_lm.data.batches import eval_windows
    from moe_lm.data.prepare import load_split

    _, model, _ = load_model(tmp_path / "straight")
    windows = eval_windows(load_split(cfg.data.out_dir, "val"), cfg.train.seq_len, cfg.train.micro_batch_size)
    with torch.no_grad():
        sums = [
            torch.nn.functional.cross_entropy(
                model(w[:, :-1]).logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"
            )
            for w in windows.values()
        ]
    main_loss = sum(sums).item() / sum(w[:, 1:].numel() for w in windows.values())
    assert evals[-1]["loss"] == pytest.approx(main_loss, rel=1e-5)


def test_crash_during_save_keeps_previous_checkpoint(tiny_data, tmp_path, train, monkeypatch):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=4, ckpt_interval=2)
    calls = {"n": 0}
    real = save_resume._rng_state

    def crash_on_second_save():
        calls["n"] += 1
        if calls["n"] == 2:  # DeepSpeed has written step 4's model and optimizer files; we die before finishing
            raise KeyboardInterrupt("killed during save")
        return real()

    monkeypatch.setattr(save_resume, "_rng_state", crash_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    run = tmp_path / "run"
    assert latest_tag(run) == "step_00000002"
    assert not (run / "checkpoints" / "step_00000004" / COMPLETE).exists()
    monkeypatch.setattr(save_resume, "_rng_state", real)
    train(cfg)  # resumes from the previous checkpoint and finishes
    assert latest_tag(run) == "step_00000004"
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]


@pytest.mark.parametrize("loss_chunk", [0, 1024])
def test_non_finite_loss_skips_the_step_and_many_stop_the_run(tiny_data, tmp_path, train, monkeypatch, loss_chunk):
    """A NaN planted in the training loss (the plain F.cross_entropy, or the chunked linear_cross_entropy, the
    default) skips that step; max_bad_steps in a row stop the run."""
    bad_steps = set()
    state = {"calls": 0}

    def poisoned(real, hidden_arg):
        def loss(*a, **k):
            out = real(*a, **k)
            if a[hidden_arg].requires_grad:  # training micro-batches only
                state["calls"] += 1
                if (state["calls"] - 1) // 2 + 1 in bad_steps:  # 2 micro-batches per step
                    out = out * float("nan")
            return out

        return loss

    if loss_chunk:
        monkeypatch.setattr(objective, "linear_cross_entropy", poisoned(objective.linear_cross_entropy, 0))
    else:
        monkeypatch.setattr(objective.F, "cross_entropy", poisoned(objective.F.cross_entropy, 0))
    bad_steps.update({3})
    cfg = tiny_train_cfg(tiny_data, tmp_path / "one_bad", max_steps=5, loss_chunk=loss_chunk)
    train(cfg)
    r = rows(tmp_path / "one_bad")
    assert [x["skipped"] for x in r] == [False, False, True, False, False]
    assert all(torch.isfinite(torch.tensor(x["loss"])) for i, x in enumerate(r) if i != 2)

    state["calls"] = 0
    bad_steps.update(range(1, 100))
    cfg = tiny_train_cfg(tiny_data, tmp_path / "all_bad", max_steps=20, max_bad_steps=3, loss_chunk=loss_chunk)
    with pytest.raises(RuntimeError, match="3 consecutive steps had a non-finite loss"):
        train(cfg)


def test_changed_model_refuses_to_resume(tmp_path, train, copied_run):
    cfg = copied_run(max_steps=2)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dim=48))
    with pytest.raises(RuntimeError, match="different model"):
        train(other)
    fresh = with_train(other, resume=False)
    train(fresh)  # starts afresh, the old run moved aside rather than deleted
    assert list(tmp_path.glob("run.prev-*"))


def test_train_cli_names_bad_config_keys(cli):
    proc = cli.script("train.py", "--config", ROOT / "configs" / "tiny.yaml", "optim.learning_rate=1e-3")
    assert proc.returncode != 0
    assert "optim.learning_rate" in proc.stderr


def test_vocab_mismatch_with_data_is_a_clear_error(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=512))
    with pytest.raises(ValueError, match="tokenized with 300 pieces"):
        train(cfg)


def test_wandb_offline_run_is_written(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, wandb_mode="offline"))
    train(cfg)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    run_id = (tmp_path / "run" / "wandb_id").read_text()
    assert runs[0].name.endswith(run_id)  # a resumed run keeps logging to the same wandb run


def test_the_training_command_runs_twice_in_one_process(tiny_data, tmp_path, cli):
    """A notebook or a sweep trains again in the process that trained before: the first run's end left the process
    group, and DeepSpeed's cached groups with it (expert-parallel groups naming a destroyed group would fail the
    second run's engine with 'Group ... is not registered')."""
    for name in ("first", "second"):
        cfg = tiny_train_cfg(tiny_data, tmp_path / name, max_steps=1)
        dump_config(cfg, tmp_path / f"{name}.yaml")
        proc = cli("train", "--config", tmp_path / f"{name}.yaml")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert latest_tag(tmp_path / name) == "step_00000001"


def test_one_rank_runs_zero_1_and_resumes_what_its_zero_2_engine_saved(tiny_data, tmp_path, train, trained_run,
                                                                      monkeypatch, capsys):  # fmt: skip
    """On one rank the engine runs ZeRO-1 although parallel.zero_stage is 2 (ZeRO-2's per-micro-batch reductions
    partition nothing there); a checkpoint the ZeRO-2 engine saved at world 1 (as every run did before) resumes into
    it and reproduces the uninterrupted run; the start-up line names the stage that runs."""
    from moe_lm.parallel import deepspeed_setup

    ZERO_2 = {"stage": 2, "contiguous_gradients": True, "reduce_scatter": True, "overlap_comm": False}
    straight = trained_run(max_steps=8, ckpt_interval=100)  # ZeRO-1's run (the reference the resume test shares)
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=8, ckpt_interval=100, stop_at=4)
    assert cfg.parallel.zero_stage == 2
    with monkeypatch.context() as m:
        m.setattr(deepspeed_setup, "zero_optimization", lambda p, world: ZERO_2)  # the engine as it was
        train(cfg)
    capsys.readouterr()
    train(with_train(cfg, stop_at=0))  # resumes from step 4 under ZeRO-1
    assert "world 1, ZeRO-1, " in capsys.readouterr().out
    for ra, rb in zip(rows(straight), rows(tmp_path / "run"), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=0), (ra["step"], ra["loss"], rb["loss"])
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-6)


def test_the_routing_numbers_of_a_logged_row_do_not_depend_on_the_steps_between_rows(tiny_data, tmp_path, train,
                                                                                    trained_run):  # fmt: skip
    """Unlogged steps skip the row's routing numbers (MaxVio, bias statistics): a row every 4 steps holds what the
    run logging every step holds at those steps."""
    every = rows(trained_run(max_steps=8, ckpt_interval=100))
    train(tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=8, ckpt_interval=100, log_interval=4))
    sparse = rows(tmp_path / "run")
    assert [r["step"] for r in sparse] == [4, 8]
    for r in sparse:
        same = every[r["step"] - 1]
        for key in ("loss", "grad_norm", "maxvio/layer_1", "bias_mean/layer_1", "bias_std/layer_1", "bias_max/layer_1"):
            assert r[key] == pytest.approx(same[key], rel=1e-6, abs=1e-9), (r["step"], key)


def test_a_one_rank_engine_keeps_no_gradient_partitions():
    """parallel.zero_stage=2 on one rank: the engine reduces once a step (ZeRO-1), not in every backward's hooks,
    and keeps no contiguous gradient buffer."""
    from moe_lm.config import OptimConfig, ParallelConfig, TrainConfig
    from moe_lm.model import Transformer
    from moe_lm.parallel.deepspeed_setup import build_engine, init_distributed
    from moe_lm.parallel.expert_parallel import apply_expert_parallel
    from moe_lm.testing import tiny_model_cfg

    init_distributed()
    model = apply_expert_parallel(Transformer(tiny_model_cfg()), 1)
    engine = build_engine(model, optim=OptimConfig(), train=TrainConfig(), parallel=ParallelConfig(zero_stage=2))
    assert engine.zero_optimization_stage() == 1 and not engine.optimizer.partition_gradients
    assert not engine.optimizer.contiguous_gradients
