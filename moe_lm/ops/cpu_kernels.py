"""The compiled CPU kernels (csrc/): the expert segments (`segment_mlp.py`) and the router's top-k
(`moe_lm/model/router.py`).

Built on first use with torch's C++ extension loader (g++ and ninja; ~1 min, cached in
~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR; `make setup` builds them), for Linux CPUs with AVX2 or AVX-512
and fp32 tensors. Elsewhere, when the build fails (one warning), or with MOE_LM_CPU_KERNEL=0, the callers run their
PyTorch code, which the tests hold the kernels to.

The build folder is one per checkout, built one at a time (`extension_builds.py` says why).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import torch

from moe_lm.ops.extension_builds import build_folder, environment_ninja, one_build_at_a_time

KERNEL_ENV = "MOE_LM_CPU_KERNEL"
_SOURCES = [Path(__file__).with_name("csrc") / f for f in ("bindings.cpp", "segment_mlp.cpp", "route_topk.cpp")]
# torch's vectorised types (at::vec) are chosen by these macros; the flags match what torch dispatches to.
_CAPABILITY_FLAGS = {
    "AVX512": [
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
    ],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"],
}


def cpu_kernels_for(*tensors: torch.Tensor | None):
    """The kernels' module when every given tensor (None: absent) is fp32 on CPU and the kernels are available."""
    if all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors):
        return load_cpu_kernels()
    return None


@functools.cache
def load_cpu_kernels():
    """The compiled kernels' module, or None where they are switched off, unsupported, or fail to build (warned)."""
    if os.environ.get(KERNEL_ENV, "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if not sys.platform.startswith("linux") or capability not in _CAPABILITY_FLAGS:
        return None  # why: only these builds are tested; elsewhere the PyTorch code is the safe choice
    from torch.utils.cpp_extension import load

    name = f"moe_lm_cpu_kernels_{capability.lower()}"
    try:
        folder = build_folder(name, _SOURCES[0].parent)
        with environment_ninja(), one_build_at_a_time(folder):
            return load(
                name=name,
                sources=[str(s) for s in _SOURCES],
                extra_cflags=["-O3", "-fopenmp", *_CAPABILITY_FLAGS[capability]],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
    except Exception as e:  # a missing compiler or ninja surfaces as several exception types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"moe_lm: could not build the CPU kernels ({reason}). The expert and router code falls back to "
            f"PyTorch: same results, slower. The kernels need a C++ compiler (g++) and ninja; set {KERNEL_ENV}=0 "
            "to skip the build.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
