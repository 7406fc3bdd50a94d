"""The `megablocks` expert backend: clear errors where it cannot run, and our glue checked against `loop`.

MegaBlocks' kernels are Triton/CUDA only. On CPU the glue (slot binning, gather with top_k, fused gate/up grouped
GEMM on our [E, 2I, D] weights, weighted scatter, the one-row-per-slot expert-parallel path) is checked with
plain-torch stand-ins that follow MegaBlocks' documented kernel semantics (megablocks/backend/kernels.py). On a
CUDA machine with the extra installed, the last tests run the real kernels.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_lm.config import load_config
from moe_lm.model import Experts, Transformer
from moe_lm.model import experts as experts_module
from moe_lm.ops import megablocks as mb
from tests.helpers.experts import routed_batch, run, slot_table


class StandInOps:
    """MegaBlocks' ops in plain torch: slots are flat token*K+k ids, `indices` lists them in expert order."""

    @staticmethod
    def sort(x, end_bit):
        values, indices = torch.sort(x, stable=True)
        return values.int(), indices.int()

    @staticmethod
    def histogram(x, num_bins):
        return torch.bincount(x, minlength=num_bins).int()

    @staticmethod
    def inclusive_cumsum(x, dim):
        return x.cumsum(dim).int()

    @staticmethod
    def gather(x, indices, bin_ids, bins, top_k):  # row i of the output is token indices[i] // top_k
        return x.index_select(0, indices.long() // top_k)

    @staticmethod
    def scatter(x, indices, bin_ids, weights, bins, top_k):  # out[t] = sum_k weights[t*K+k] * x[position of t*K+k]
        idx = indices.long()
        per_slot = torch.zeros_like(x).index_copy(0, idx, x * weights[idx, None])
        return per_slot.view(-1, top_k, x.shape[1]).sum(1)


def stand_in_gmm(a, b, batch_sizes, trans_b=False):
    assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.long  # grouped_gemm's contract
    outs, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        outs.append(a[start : start + n] @ (b[e].T if trans_b else b[e]))
        start += n
    return torch.cat(outs)


STAND_IN = SimpleNamespace(ops=StandInOps, gmm=stand_in_gmm)


@pytest.fixture
def no_cached_backend():
    mb.load_megablocks.cache_clear()
    yield
    mb.load_megablocks.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_without_cuda_the_error_names_cuda_and_the_alternative(no_cached_backend):
    with pytest.raises(mb.BackendUnavailable, match=r"needs a CUDA GPU.*experts_impl='grouped'"):
        Experts(4, 16, 8, "megablocks")
    cfg = load_config("configs/tiny.yaml", ["model.moe.experts_impl=megablocks"])
    with pytest.raises(mb.BackendUnavailable, match="needs a CUDA GPU"):  # at construction, before any training
        Transformer(cfg.model)


def test_without_the_package_the_error_names_it_and_how_to_install(monkeypatch, no_cached_backend):
    import builtins

    real_import = builtins.__import__

    def import_without_megablocks(name, *args, **kwargs):
        if name.split(".")[0] in ("megablocks", "grouped_gemm"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builtins, "__import__", import_without_megablocks)
    with pytest.raises(mb.BackendUnavailable, match=r"needs the megablocks package.*pip install --no-deps"):
        Experts(4, 16, 8, "megablocks")


def test_cpu_tensors_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(experts_module, "load_megablocks", lambda: STAND_IN)
    experts = Experts(4, 16, 8, "megablocks")
    x, idx, w = torch.randn(6, 16), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors.*experts_impl='grouped'"):
        experts(x, idx, w)


@pytest.mark.parametrize("E, K", [(4, 1), (8, 2), (16, 5)])
def test_glue_equals_loop_outputs_and_gradients(E, K):
    torch.manual_seed(E + K)
    x, idx, w = routed_batch(40, E, K, unused=(1,))
    ref_experts = Experts(E, 16, 12, "loop").double()
    grad = torch.randn(40, 16, dtype=torch.float64)
    ref = run(ref_experts, "loop", x, idx, w, grad)

    x.grad = w.grad = None
    ref_experts.zero_grad(set_to_none=True)
    y = mb.dmoe(STAND_IN, x, idx, w, ref_experts.gate_up_proj, ref_experts.down_proj)
    y.backward(grad)
    got = [y.detach(), x.grad, w.grad, ref_experts.gate_up_proj.grad, ref_experts.down_proj.grad]
    for name, a, b in zip(["y", "dx", "dw", "d_gate_up", "d_down"], ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)
    assert ref_experts.gate_up_proj.grad[1].abs().max() == 0  # the idle expert


def test_slots_entry_point_equals_loop():
    """Expert-parallel dispatch hands over received rows with a varying number of local slots each."""
    torch.manual_seed(0)
    experts = Experts(4, 16, 12, "loop").double()
    x = torch.randn(10, 16, dtype=torch.float64)
    rows = torch.tensor([0, 0, 1, 3, 3, 3, 4, 7, 9, 9])  # rows 2, 5, 6, 8 have no local slot
    expert = torch.tensor([0, 2, 1, 0, 1, 3, 2, 2, 3, 0])
    w = torch.rand(10, dtype=torch.float64)
    expert_MK, w_MK, slot_N = slot_table(rows.tolist(), expert.tolist(), w, 10)
    ref = experts.forward_slots(x, expert_MK, w_MK, slot_N)
    got = mb.slots_through(STAND_IN, x, expert_MK, w_MK, experts.gate_up_proj, experts.down_proj, slot_N)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_offline_loading_of_a_megablocks_run_uses_grouped(tmp_path, copied_run):
    """A run trained with megablocks on a GPU can be analysed and exported on a CPU: the weights are the same."""
    from moe_lm.checkpoint.format import latest_tag, load_model

    copied_run(max_steps=1)  # its checkpoint's config is rewritten below as a megablocks run's
    _, model, tag = load_model(tmp_path / "run")
    config_file = tmp_path / "run" / "checkpoints" / latest_tag(tmp_path / "run") / "config.yaml"
    text = config_file.read_text()
    assert "experts_impl: grouped" in text
    config_file.write_text(text.replace("experts_impl: grouped", "experts_impl: megablocks"))
    _, reloaded, _ = load_model(tmp_path / "run", tag)
    assert reloaded.moe_layers()[0].experts.impl == "grouped"
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def _gpu_backend_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        mb.load_megablocks.cache_clear()
        mb.load_megablocks()
    except mb.BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["grouped", "megablocks"])
def test_cuda_kernels_equal_loop_in_bf16(impl):
    """GPU only: torch._grouped_mm (grouped) and MegaBlocks' kernels against the loop reference, bf16."""
    if impl == "megablocks":
        _gpu_backend_or_skip()
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    E, K, T = 16, 4, 512
    experts = Experts(E, 256, 128, "loop").cuda().bfloat16()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(T, K, device="cuda", requires_grad=True)
    grad = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    ref = run(experts, "loop", x, idx, w, grad)
    got = run(experts, impl, x, idx, w, grad)
    for name, a, b in zip(["y", "dx", "dw", "d_gate_up", "d_down"], ref, got, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.gpu
def test_cuda_training_step_with_megablocks_equals_loop():
    """GPU only: a whole model's loss and an AdamW step agree between MegaBlocks' kernels and the loop, bf16."""
    _gpu_backend_or_skip()
    from moe_lm.testing import replace_moe, tiny_model_cfg

    losses = {}
    for impl in ("loop", "megablocks"):
        torch.manual_seed(0)
        model = Transformer(replace_moe(tiny_model_cfg(), experts_impl=impl)).cuda().bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 97, (4, 64), device="cuda")
        for _ in range(2):
            out = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            opt.zero_grad()
            (loss + out.aux_loss).backward()
            opt.step()
        losses[impl] = loss.item()
    assert abs(losses["megablocks"] - losses["loop"]) <= 2e-2 * abs(losses["loop"])
