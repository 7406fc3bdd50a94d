"""The formats `moe-lm prune` writes a pruned model in, one writer each; the subject's kind says which
(`SubjectKind.prune_source`), sources.py takes it from there:

    format        the source                                the pruned model                 prune.json, the trace
    run           a moe-lm run's checkpoint                 a pruned run folder (run.py)     in it
    transformers  a DeepseekV3/Glm4Moe/Qwen3Moe folder      a new folder (hf_folder.py)      in it
    fp8-release   DeepSeek's FP8 release                    a new release (fp8_release.py)   in it
    gguf          a GGUF file                               a new file (gguf_file.py)        <out>.prune.json,
                                                                                             <out>.calibration_trace/

Each reads, without the weights, the routing a plan must keep valid (`shape`) and the MoE layers the written model
holds (`layers`: a transformers folder's and a GGUF file's MTP / NextN layers included, which a pruned run leaves
out), checks `--out` before anything slow runs (`check_out`), and writes the plan's model with prune.json and the
calibration trace in the folder before it is put in place, or beside the file (`write`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from moe_lm.errors import UserError
from moe_lm.interop.gguf_header import read_gguf_header
from moe_lm.interop.released_weights import ReleasedWeights, block_size
from moe_lm.pruning import fp8_release, hf_folder
from moe_lm.pruning.gguf_file import gguf_routing, prune_gguf
from moe_lm.pruning.output import pruned_output
from moe_lm.pruning.plan import PLAN_FILE, KeepPlan, RoutingShape
from moe_lm.pruning.safetensors_shards import folder_routing

TRACE_FOLDER = "calibration_trace"
# the types whose pruned copy computes the source with the pruned experts masked before selection: sigmoid routers
# with a selection bias (the pruned experts' bias at -inf), and Qwen3-MoE's softmax with its top-k renormalised
# (the softmax over the kept experts alone, renormalised, gives the kept experts' weights of the masked softmax)
MODEL_TYPES = ("deepseek_v3", "glm4_moe", "qwen3_moe")
Finish = Callable[[Path, str], None]  # (folder, prefix): prune.json and the trace written as <folder>/<prefix><name>


class PrunedFormat(ABC):
    """A source pruned into its own format, made from the subject's request and the path its kind names
    (`__init__(request, path)`, reading no weights). `source`: what is read (never written); `shape`: its routing;
    `layers`: the MoE layers the written model holds, each of which a plan names; `what`: the output, and `flag`,
    the flag that reads it, for the console."""

    source: Path
    shape: RoutingShape
    layers: list[int]
    format_name: str
    what: str
    flag: str
    sidecars: bool = False  # prune.json and the trace beside the output (a file), not in it

    def place(self, out: Path, name: str) -> Path:
        """Where `name` (prune.json, the calibration trace) ends up for the output `out`."""
        return out.with_name(f"{out.name}.{name}") if self.sidecars else out / name

    def about(self) -> dict:
        """The source, for prune.json."""
        return {"format": self.format_name, "path": str(self.source)}

    @abstractmethod
    def check_out(self, out: Path, force: bool) -> None:
        """A UserError for an `out` the pruned model may not be written to, before anything slow runs."""

    @abstractmethod
    def write(self, plan: KeepPlan, out: Path, finish: Finish) -> None:
        """The pruned model of `plan` written to `out`, `finish` writing prune.json and the trace with it."""

    def summary(self, plan: KeepPlan) -> str:
        """What was written, in a line (the count per layer follows on the console)."""
        layers, criterion = len(plan.layers), plan.about.get("criterion")
        return f"kept {plan.n_keep} of {plan.n_experts} routed experts in each of {layers} MoE layers ({criterion})"


class SafetensorsFormat(PrunedFormat):
    """A transformers folder (`moe-lm export`, save_pretrained: DeepseekV3, Glm4Moe, Qwen3Moe) pruned into a new
    folder."""

    format_name, what, flag = "transformers", "transformers folder", "--hf"
    writer = staticmethod(hf_folder.prune_hf_folder)
    fix = hf_folder.FIX

    def __init__(self, request, source: Path) -> None:
        self.source = Path(source)
        config = hf_folder.read_config(self.source)
        if config.get("model_type") not in MODEL_TYPES:  # why: what the pruned copy computes is known for these only
            raise UserError(f"{self.source / 'config.json'}: model_type {config.get('model_type')!r}; moe-lm prune "
                            f"writes {', '.join(MODEL_TYPES)} folders (routers where removing an expert is masking "
                            "its score)")  # fmt: skip
        if config.get("model_type") == "qwen3_moe" and not config.get("norm_topk_prob"):
            raise UserError(f"{self.source / 'config.json'}: norm_topk_prob is false, so each chosen expert's weight "
                            "is its softmax share of every expert: a pruned copy would weigh the kept experts more "
                            "than the source does with the pruned ones masked; moe-lm prune writes Qwen3-MoE "
                            "folders with norm_topk_prob true (as Qwen3's releases have it)")  # fmt: skip
        self.check_source(config)
        E, k, groups, used, self.layers = folder_routing(self.source, config, self.fix)
        self.shape = RoutingShape(E, groups, used, k)

    def check_source(self, config: dict) -> None:
        if config.get("quantization_config"):
            block_size(config, self.source)  # why: names a quantisation moe-lm does not read

    def check_out(self, out: Path, force: bool) -> None:
        refuse_force(self, force)
        pruned_output(self.source, out)

    def write(self, plan: KeepPlan, out: Path, finish: Finish) -> None:
        ungroup = plan.n_group != self.shape.n_group
        self.writer(self.source, out, plan.kept, extras=lambda stage: finish(stage, ""), ungroup=ungroup)


class FP8ReleaseFormat(SafetensorsFormat):
    """DeepSeek's FP8 release pruned into a new release, streamed byte for byte (nothing dequantised)."""

    format_name, what, flag = "fp8-release", "FP8 release", "--hf"
    writer = staticmethod(fp8_release.prune_fp8_release)
    fix = fp8_release.FIX

    def check_source(self, config: dict) -> None:
        block_size(config, self.source)  # a quantisation other than DeepSeek's FP8 blocks, refused by name
        weights = ReleasedWeights(self.source, config)
        weights.check(weights.names())  # why here: a damaged release fails before the calibration, not after it


class GGUFFormat(PrunedFormat):
    """A GGUF file pruned into a new file (its experts' bytes sliced, quantised types included); prune.json and the
    calibration trace beside it, as <out>.prune.json and <out>.calibration_trace/."""

    format_name, what, flag, sidecars = "gguf", "GGUF file", "--gguf", True

    def __init__(self, request, source: Path) -> None:
        self.source = Path(source)
        E, k, groups, used, self.layers = gguf_routing(read_gguf_header(self.source))
        self.shape = RoutingShape(E, groups, used, k)

    def check_out(self, out: Path, force: bool) -> None:
        refuse_force(self, force)
        pruned_output(self.source, out, file=True)
        for name in (PLAN_FILE, TRACE_FOLDER):
            if os.path.lexists(self.place(out, name)):
                raise UserError(f"--out {out}: {self.place(out, name)} exists (what moe-lm prune writes beside the "
                                "file); give a new file name (nothing was written)")  # fmt: skip

    def write(self, plan: KeepPlan, out: Path, finish: Finish) -> None:
        prune_gguf(self.source, out, plan.kept, ungroup=plan.n_group != self.shape.n_group)
        try:
            finish(out.parent, f"{out.name}.")
        except BaseException:  # why: a GGUF file without its plan beside it is not what was asked; both are ours
            with contextlib.suppress(OSError):
                out.unlink()
            for name in (PLAN_FILE, TRACE_FOLDER):
                path = self.place(out, name)
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            raise


def refuse_force(fmt: PrunedFormat, force: bool) -> None:
    """--force moves an earlier output aside; a pruned copy is only ever written new (output.py)."""
    if force:
        raise UserError(f"--force: a pruned {fmt.what} is always written new, never over anything (an earlier copy "
                        "included); give a new path and leave out --force")  # fmt: skip
