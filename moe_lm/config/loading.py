"""Loading a config: a YAML preset (shipped in moe_lm/configs, or a file) with its `base:` chain, dotted
overrides, the renamed keys put where they live now, decoded into the schema and validated once; and writing one.

    cfg = load_config("configs/tiny.yaml", ["optim.lr=3e-4", "model.moe.n_routed_experts=16"])
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from moe_lm.config.decode import from_dict
from moe_lm.config.moved_keys import moved_keys, new_spelling
from moe_lm.config.schema import Config
from moe_lm.errors import ConfigError, shown

PRESETS = Path(__file__).resolve().parents[1] / "configs"  # shipped with the package


def presets() -> list[str]:
    """The names of the presets shipped with the package (`--config NAME`)."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """A preset's file, or the YAML file `name` is a path to (relative to the working directory)."""
    if name in presets():
        return PRESETS / f"{name}.yaml"
    path = Path(name)
    if path.is_file():
        return path
    raise ConfigError(f"--config {name}: no such file, and no preset of that name (presets: {', '.join(presets())})")


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML preset (or the defaults when `path` is None), apply `key.sub=value` overrides, validate.

    A preset may start from another with `base: other.yaml` (relative to its own folder): its keys are merged over
    the base's, section by section.
    """
    raw = read_preset(Path(path)) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {shown(item)} must look like section.key=value")
        try:
            parsed = safe_yaml(value) if value.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {shown(item)}: the value is not valid YAML ({yaml_problem(e)})") from None
        _set_dotted(raw, new_spelling(key.strip(), "an override"), parsed)
    cfg = from_dict(Config, raw)
    cfg.validate()
    return cfg


def read_preset(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The raw mapping of a preset file with its `base:` chain merged in; errors name the file (and line)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (presets live in configs/)")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: `base:` chain loops back to itself ({' -> '.join(map(str, chain))})")
    try:
        loaded = safe_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML, {yaml_problem(e)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
    raw = moved_keys(loaded or {}, str(path))
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: `base` must be a file name, got {shown(base)}")
    return _merge(read_preset(path.parent / base, (*chain, path.resolve())), raw)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class _NoAliases(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: `*name` repeats a node, and a few nested ones (a 2 KB "billion laughs"
    file) expand to gigabytes. moe-lm's presets use none."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not accepted here; write the value out", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


def safe_yaml(text: str):
    """`yaml.safe_load(text)` refusing aliases (yaml.YAMLError naming the line)."""
    return yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> str:
    """Where and what, in one line (PyYAML's own message adds the offending line and a caret below it)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(e, "problem", None) or e)[:200]


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (it loads back to an equal config)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value
