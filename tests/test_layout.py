"""The house rules, read from the source: which rooms may import what, no import circle, no long function.

- moe_lm/model/ is single-device PyTorch: it never imports torch.distributed or deepspeed.
- DeepSpeed enters through parallel/, train/ and checkpoint/save_resume.py only (the checkpoint format reader, the
  analytics, interop and inference open runs without it).
- Nothing but entry points imports the command line (moe_lm/cli).
- The core (the DeepSeek-V3 trainer) never imports the experiments, their research variants or the command line:
  variants plug in through the core's extension points (model/masks.py, model/architectures.py,
  train/objective.py).
- No two modules of the package import each other, directly or around a circle (imports inside functions count).
- The rooms stand on floors (FLOORS, ground first): no module imports a room above its own, imports inside
  functions included; DeepSpeed's layouts on paper (deepspeed_layout) sit under everything that reads them.
- The core never imports the tools around it: the planner (planning), analytics, experiments, benchmarks.
- No function in moe_lm/ or launch/ is longer than 70 lines.
- A test file trains, runs commands and starts processes only through the fixtures that mark its tier
  (tests/conftest.py), so that `make test-fast` and the serial launch phase hold what they say.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_lm"
CORE = (
    "deepspeed_layout",
    "model",
    "ops",
    "parallel",
    "train",
    "data",
    "inference",
    "checkpoint",
    "interop",
    "routing",
    "config",
    "errors",
    "compat",
    "files",
    "output_folder",
)
MAX_FUNCTION_LINES = 70
# the rooms of the package, ground first: a module may import its own room and the rooms below it, never above
FLOORS = (
    "errors",
    "compat",
    "files",
    "flags",
    "console",
    "ops",
    "config",
    "output_folder",
    "model",
    "data",
    "routing",
    "deepspeed_layout",
    "parallel",
    "checkpoint",
    "planning",
    "inference",
    "interop",
    "train",
    "analysis",
    "pruning",
    "experiments",
    "config_docs",
    "cli",
    "bench",
    "testing",
)
TOOLS = ("planning", "analysis", "pruning", "experiments", "bench", "cli", "testing")  # what the core never imports


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, those inside functions included; `from a import b` yields a.b
    when a.b is a module of the package, else a."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.append((node.lineno, sub if _is_module(sub) else node.module))
    return found


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_model_code_is_single_device():
    """Nothing under moe_lm/model imports torch.distributed or deepspeed (parallelism is applied from outside)."""
    offenders = []
    for path in (PACKAGE / "model").rglob("*.py"):
        offenders += [
            f"{path.name}:{line} {m}" for line, m in imports(path) if m.startswith(("torch.distributed", "deepspeed"))
        ]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "distributed":  # torch.distributed.x without import
                offenders.append(f"{path.name}:{node.lineno} uses .distributed")
    assert not offenders, offenders


def test_only_parallel_train_and_save_resume_import_deepspeed():
    """The DeepSpeed-free seam: the checkpoint format reader, analytics, interop and inference never import it."""
    allowed = ("moe_lm.parallel", "moe_lm.train", "moe_lm.checkpoint.save_resume", "moe_lm.bench")
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in package_files()
        if not module_name(path).startswith(allowed)
        for line, m in imports(path)
        if m.split(".")[0] == "deepspeed"
    ]
    assert not offenders, offenders


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "moe_lm" and len(parts) > 1 else None


def test_every_import_points_down_the_floors():
    """Each room imports only rooms on lower floors (FLOORS); a room not on the list is an error too, so a new room
    must be given its floor."""
    rooms = {room_of(module_name(p)) for p in package_files()} - {None, "__main__"}
    assert rooms <= set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}"
    up = []
    for path in package_files():
        mine = room_of(module_name(path))
        for line, m in imports(path):
            theirs = room_of(m)
            if theirs and mine and theirs != mine and FLOORS.index(theirs) > FLOORS.index(mine):
                up.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {m} ({theirs}, a floor above)")
    assert not up, up


def test_the_core_never_imports_the_tools():
    """The trainer and its parts never import the planner, the analytics, the experiments, the benchmarks or the
    command line: those read the core, not the other way round."""
    core = tuple(f"moe_lm.{room}" for room in CORE)
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {m}" for path in package_files()
                 if module_name(path).startswith(core) for line, m in imports(path)
                 if room_of(m) in TOOLS]  # fmt: skip
    assert not offenders, offenders


def test_the_core_never_imports_experiments_or_the_command_line():
    """torchtitan's rule for its experiments/: they reuse the core through extension points; the core never
    imports them (nor the command line above everything)."""
    core = tuple(f"moe_lm.{room}" for room in CORE)
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {m}"
        for path in package_files()
        if module_name(path).startswith(core)
        for line, m in imports(path)
        if m.startswith(("moe_lm.experiments", "moe_lm.cli", "launch"))
    ]
    assert not offenders, offenders


def test_only_entry_points_import_the_command_line():
    """The command line sits above everything: analytics, experiments and benchmarks take checked arguments and
    raise moe_lm.errors, they do not reach up into moe_lm/cli (only `python -m` entry points do)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {m}"
        for path in package_files()
        if not module_name(path).startswith("moe_lm.cli") and path.name != "__main__.py"
        for line, m in imports(path)
        if m.startswith("moe_lm.cli")
    ]
    assert not offenders, offenders


def test_no_import_circle():
    graph = {module_name(p): {m for _, m in imports(p) if m.startswith("moe_lm")} for p in package_files()}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # why a package's own __init__ is left out of a circle: `import moe_lm.model.x` runs moe_lm/model/__init__.py
    # first, which may import x back; Python handles that order, and it is not two rooms depending on each other
    circles = [c for c in circles if not _through_own_init(c)]
    assert not circles, circles


def _through_own_init(circle: str) -> bool:
    names = circle.split(" -> ")
    return any(b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(names, names[1:], strict=False))


def test_no_function_longer_than_the_house_limit():
    long = []
    for path in [*package_files(), *sorted((ROOT / "launch").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


# what a test file reaches only through the fixtures of tests/conftest.py (train, trained_run, cli, process,
# launcher, ranks): each of these trains, runs a command or starts processes
_MACHINERY_IMPORTS = ("subprocess", "multiprocessing", "tests.helpers.commands", "tests.helpers.distributed",
                      "tests.helpers.ranks")  # fmt: skip


def machinery_used(path: Path) -> list[str]:
    """Where a test file trains (loop.train), runs a command (a moe_lm.cli module's main) or imports what starts
    processes, other than through the fixtures."""
    found = [f"{line} imports {m}" for line, m in imports(path) if m.startswith(_MACHINERY_IMPORTS)]
    tree = ast.parse(path.read_text())
    commands = {"loop": "train"}  # name -> the attribute that runs it
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_lm.cli"):
            for a in node.names:
                if a.name == "main":
                    found.append(f"{node.lineno} imports a command's main from {node.module}")
                elif _is_module(f"{node.module}.{a.name}"):
                    commands[a.asname or a.name] = "main"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        ):
            if commands.get(node.func.value.id) == node.func.attr:
                found.append(f"{node.lineno} calls {node.func.value.id}.{node.func.attr}")
    return found


def test_tests_reach_the_running_machinery_through_their_fixtures():
    """The tiers are marked from the fixtures a test uses; a test file that trained, ran a command or started a
    process some other way would land in `make test-fast` or run beside the serial launch tests."""
    offenders = [f"{p.relative_to(ROOT)}:{where}" for p in sorted((ROOT / "tests").rglob("test_*.py"))
                 for where in machinery_used(p)]  # fmt: skip
    assert not offenders, "use the fixtures (tests/README.md):\n" + "\n".join(offenders)


def test_the_readme_layout_block_is_the_tree_and_names_the_core():
    """Every room of the package (a sub-package or a top-level module) has its line in the README's layout block,
    and no line names a room that is gone; the README names the same core rooms as CORE."""
    text = ROOT.joinpath("README.md").read_text()
    block = text.split("## Layout")[1].split("```")[1]
    listed = {line.split()[0].rstrip("/") for line in block.splitlines() if line.startswith("moe_lm/")}
    rooms = {
        f"moe_lm/{p.name}"
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert listed - {"moe_lm/configs"} == rooms  # configs/: the presets, data rather than code
    named = re.search(r"The DeepSeek-V3 trainer is the core \(([^)]*)\)", text)
    assert named and [r.strip() for r in named[1].replace("\n", " ").split(",")] == list(CORE)
