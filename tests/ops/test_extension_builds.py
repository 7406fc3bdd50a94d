"""Where torch builds moe-lm's C++ extensions (moe_lm/ops/extension_builds.py): a build that was killed never hangs
the next start, and the build runs with this environment's ninja.

The tests that plant a killed build's `lock` do it in a build root of their own (TORCH_EXTENSIONS_DIR), seeded with
a copy of the shared build: a `lock` written into the shared folder without its flock could land between another
process's removal of a stale one and torch's own acquire, and that process (a test's training run on the other
pytest worker, under load) then waited forever holding the flock, and every later start with it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moe_lm.ops import cpu_kernels as ck
from moe_lm.ops.extension_builds import build_folder, environment_ninja, one_build_at_a_time
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


def private_build(monkeypatch, tmp_path, name: str, sources: Path) -> tuple[Path, dict]:
    """A build root of this test's own, holding a copy of the shared build folder of extension `name` (copied under
    that folder's flock, with its times, so ninja finds it up to date): (the copy, the variables that point a
    process at it)."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    shared = build_folder(name, sources)
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    mine = build_folder(name, sources)
    with one_build_at_a_time(shared):
        shutil.copytree(shared, mine, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".moe_lm_build.lock", "lock"))
    return mine, {"TORCH_EXTENSIONS_DIR": str(root)}


def test_a_lock_left_by_a_killed_kernel_build_does_not_hang_the_next_load(process, monkeypatch, tmp_path):
    """Ctrl-C during the first build leaves torch's `lock` file in the build folder; torch alone would wait on it
    forever. A fresh interpreter loads the kernels all the same."""
    if os.environ.get(ck.KERNEL_ENV) == "0" or ck.load_cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels are switched off or not built on this platform")
    capability = torch.backends.cpu.get_cpu_capability().lower()
    folder, env = private_build(monkeypatch, tmp_path, f"moe_lm_cpu_kernels_{capability}", ck._SOURCES[0].parent)
    (folder / "lock").write_text("")  # what the killed build left
    code = "from moe_lm.ops.cpu_kernels import load_cpu_kernels as k; m = k(); print(m.__name__ if m else None)"
    out = process.python(code, env=process.clean_env(env), timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == f"moe_lm_cpu_kernels_{capability}", out.stderr[-2000:]
    assert not (folder / "lock").exists()


def test_a_lock_left_by_a_killed_deepspeed_op_build_does_not_hang_the_next_start(process, monkeypatch, tmp_path):
    """The same for DeepSpeed's shared-memory communication op, which `deepspeed.init_distributed` builds on CPU
    (a `make setup` killed there once left CI waiting on that `lock` until its time ran out). Two ranks of one host
    start together, as under the launcher: the build is serialised without making either wait for the other's
    rendezvous. DeepSpeed builds the op in moe-lm's own folder, and the variable that points it there is given back."""
    import deepspeed

    package = Path(deepspeed.__file__).parent
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    if not any((build_folder("deepspeed", package) / "deepspeed_shm_comm").glob("*.so")):
        pytest.skip("DeepSpeed's CPU op is not built here (make setup builds it)")
    root, env = private_build(monkeypatch, tmp_path, "deepspeed", package)
    folder = root / "deepspeed_shm_comm"
    (folder / "lock").write_text("")  # what the killed build left
    code = (
        "import os; from moe_lm.parallel.deepspeed_setup import init_distributed as i, shutdown_distributed as s\n"
        "i(); s(); print(os.environ.get('TORCH_EXTENSIONS_DIR'))"
    )
    port = str(free_port())
    envs = []
    for rank in (0, 1):
        rank_env = process.clean_env(dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=port))
        envs.append({**rank_env, "MASTER_ADDR": "127.0.0.1", **env})
    for out in process.pythons_together(code, envs, timeout=600):
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == env["TORCH_EXTENSIONS_DIR"], out.stdout[-2000:]
    assert not (folder / "lock").exists()
    assert any(folder.glob("deepspeed_shm_comm*.so")), "DeepSpeed built (or loaded) its op in moe-lm's folder"


def test_one_process_builds_no_deepspeed_op(process, tmp_path):
    """A single process (a plain `moe-lm train`) reduces nothing: DeepSpeed's shared-memory op is neither built nor
    loaded (its build is a minute of g++ in a new installation), and the group still reduces through gloo."""
    root = tmp_path / "torch_extensions"  # empty: any build or load of an op would make folders here
    code = (
        "import torch, torch.distributed as dist, deepspeed\n"
        "from moe_lm.parallel.deepspeed_setup import init_distributed as i, shutdown_distributed as s\n"
        "i(); x = torch.ones(2); dist.all_reduce(x)\n"
        "print(deepspeed.comm.comm.cdb.shm_comm_op, x.tolist()); s()"
    )
    out = process.python(code, env=process.clean_env({"TORCH_EXTENSIONS_DIR": str(root)}), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "None [1.0, 1.0]" and not root.exists(), out.stdout[-2000:]
