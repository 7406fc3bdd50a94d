"""Where torch builds moe-lm's C++ extensions (moe_lm/ops/extension_builds.py): a build that was killed never hangs
the next start, and the build runs with this environment's ninja."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moe_lm.ops import cpu_kernels as ck
from moe_lm.ops.extension_builds import build_folder, environment_ninja
from moe_lm.parallel.ports import free_port


def test_extensions_build_with_the_ninja_of_this_environment(monkeypatch):
    """torch runs the `ninja` PATH finds; the kernels (and DeepSpeed's CPU op) are built with the one beside this
    interpreter whatever PATH says, so an activated and a plain venv never alternate ninja versions, each of which
    would rebuild the cached extension from scratch."""
    beside = Path(sys.executable).with_name("ninja")
    assert beside.is_file(), "ninja (a DeepSpeed dependency) is installed beside the interpreter"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a shell where the venv is not activated
    before = os.environ["PATH"]
    with environment_ninja():
        assert shutil.which("ninja") == str(beside)
    assert os.environ["PATH"] == before


def test_a_lock_left_by_a_killed_kernel_build_does_not_hang_the_next_load(process):
    """Ctrl-C during the first build leaves torch's `lock` file in the build folder; torch alone would wait on it
    forever. A fresh interpreter loads the kernels all the same."""
    if os.environ.get(ck.KERNEL_ENV) == "0" or ck.load_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels are switched off or not built on this platform")
    capability = torch.backends.cpu.get_cpu_capability().lower()
    folder = build_folder(f"moe_lm_cpu_kernels_{capability}", ck._SOURCES[0].parent)
    (folder / "lock").write_text("")  # what the killed build left
    code = "from moe_lm.ops.cpu_kernels import load_cpu_kernels as k; m = k(); print(m.__name__ if m else None)"
    out = process.python(code, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == f"moe_lm_cpu_kernels_{capability}", out.stderr[-2000:]
    assert not (folder / "lock").exists()


def test_a_lock_left_by_a_killed_deepspeed_op_build_does_not_hang_the_next_start(process):
    """The same for DeepSpeed's shared-memory communication op, which `deepspeed.init_distributed` builds on CPU
    (a `make setup` killed there once left CI waiting on that `lock` until its time ran out). Two ranks of one host
    start together, as under the launcher: the build is serialised without making either wait for the other's
    rendezvous. DeepSpeed builds the op in moe-lm's own folder, and the variable that points it there is given back."""
    import deepspeed

    folder = build_folder("deepspeed", Path(deepspeed.__file__).parent) / "deepspeed_shm_comm"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").write_text("")  # what the killed build left
    code = (
        "import os; from moe_lm.parallel.deepspeed_setup import init_distributed as i, shutdown_distributed as s\n"
        "i(); s(); print(os.environ.get('TORCH_EXTENSIONS_DIR'))"
    )
    port = str(free_port())
    envs = []
    for rank in (0, 1):
        env = process.clean_env(dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=port))
        env.update(MASTER_ADDR="127.0.0.1")
        env.pop("TORCH_EXTENSIONS_DIR", None)
        envs.append(env)
    for out in process.pythons_together(code, envs, timeout=600):
        assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "None", out.stderr[-2000:]
    assert not (folder / "lock").exists()
    assert any(folder.glob("deepspeed_shm_comm*.so")), "DeepSpeed built (or loaded) its op in moe-lm's folder"
