"""The config reference (docs/config.md), generated from the config classes: every key with its type, default and
meaning, the meaning taken from the comment above the field in moe_lm/config/schema.py (its single source)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, Literal

from moe_lm import config as C
from moe_lm.config import schema
from moe_lm.config.choices import CHOICES

HEADER = """# Config reference

Every key of the config tree, generated from the config classes in `moe_lm/config/schema.py` (`moe-lm config
--reference`; a test keeps this file current). Set keys in a YAML preset (`--config NAME|FILE`, a preset may start
from another with `base: other.yaml`) or as dotted overrides on the command line (`optim.lr=1e-3`). `moe-lm config
--config X [overrides]` prints a resolved config. Keys renamed when the training section was split still load, with
a note, until moe-lm {until} (then the old spelling is an error naming the new one): {moved}.
"""


def field_comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment lines right above the field, joined."""
    source = Path(inspect.getsourcefile(schema)).read_text()
    lines = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                above, i = [], item.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                out[node.name, item.target.id] = " ".join(above)
    return out


def reference() -> str:
    comments, hints = field_comments(), typing.get_type_hints(C.Config)
    moved = ", ".join(f"`{old}` → `{new}`" for old, new in C.MOVED.items())
    parts = [HEADER.format(moved=moved, until=".".join(map(str, C.MOVED_UNTIL)))]
    for f in dataclasses.fields(C.Config):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            parts += _section(f.name, tp, comments)
        else:
            parts.append(f"`{f.name}` ({_type(tp, f.name)}, default `{_default(f)}`): {comments[('Config', f.name)]}\n")
    return "\n".join(parts)


def _section(path: str, cls: type, comments: dict) -> list[str]:
    doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
    rows = [f"## `{path}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.append((f"{path}.{f.name}", tp))
            continue
        key = f"{path}.{f.name}"
        rows.append(f"| `{key}` | {_type(tp, key)} | `{_default(f)}` | {comments.get((cls.__name__, f.name), '')} |")
    out = [*rows, ""]
    for sub_path, sub in nested:
        out += _section(sub_path, sub, comments)
    return out


def _type(tp: Any, key: str) -> str:
    if key in CHOICES:
        return "one of " + ", ".join(f"`{c}`" for c in C.choices(key))
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return f"`{choices[0]}`" if len(choices) == 1 else "one of " + ", ".join(f"`{c}`" for c in choices)
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(_type(a, key) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {typing.get_args(tp)[0].__name__}"
    return tp.__name__


def _default(f: dataclasses.Field) -> Any:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return "true" if value is True else "false" if value is False else value
