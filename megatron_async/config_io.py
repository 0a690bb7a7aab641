"""The config's files: YAML files and dotted command-line overrides set onto the config's
dataclasses (each value checked against its field's type), and the config written back out.

    apply_file(cfg, "configs/cpu_tiny.yaml"); apply_overrides(cfg, ["trainer.lr=1e-6"])  # config.load_config
    save_config(cfg, run_dir / "config.yaml")      # secrets redacted
    explain(Config(), "trainer.lr")                # a key's type, default and help

It knows dataclasses, not this project's keys (config.py declares them and checks their values):
unknown keys, keys given twice in a file and wrong types are refused here, each with one
`ConfigError` naming the key, the value and where it came from (file or command line).
"""
from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from megatron_async.io_utils import atomic_write_text

_FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the value."""


def apply_file(root: Any, path: str | os.PathLike) -> None:
    """Set the keys of the YAML file at `path` on `root` (a config dataclass)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with open(p, "rb") as f:  # a named stream: DuplicateKeyLoader names the file
            data = yaml.load(f, Loader=DuplicateKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    _apply_mapping(root, data, prefix="", source=str(p))


def apply_overrides(root: Any, overrides: Sequence[str]) -> None:
    """Set `key.sub=value` overrides (the command line's) on `root`; each value is read as YAML."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(root, key.strip(), value, source="command line")


class DuplicateKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, at any depth: PyYAML keeps the
    last one silently, so a key set again further down a config file would quietly win over the
    first. Raises ConfigError naming the file, the key and both lines. Merge keys (`<<: *anchor`)
    may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):  # SafeLoader's own error says so
                break
            if key in first_line:
                raise ConfigError(f"{key_node.start_mark.name}: key {key!r} given twice (lines "
                                  f"{first_line[key]} and {line})")
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _apply_mapping(obj: Any, data: dict, prefix: str, source: str) -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dataclasses.is_dataclass(_field_value(obj, str(key), dotted, source)):
            _apply_mapping(getattr(obj, key), value, prefix=f"{dotted}.", source=source)
        else:
            _set_dotted(obj, str(key), value, source=source, full_key=dotted)


def _field_value(obj: Any, key: str, dotted: str, source: str) -> Any:
    names = [f.name for f in dataclasses.fields(obj)]
    if key not in names:
        raise ConfigError(f"{source}: unknown key '{dotted}' (known here: {', '.join(names)})")
    return getattr(obj, key)


def _set_dotted(cfg: Any, key: str, value: Any, source: str, full_key: str | None = None) -> None:
    full_key = full_key or key
    *parents, leaf = key.split(".")
    obj, walked = cfg, []
    for part in parents:
        walked.append(part)
        obj = _field_value(obj, part, ".".join(walked), source)
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"{source}: '{'.'.join(walked)}' is a value, not a section (key '{full_key}')")
    current = _field_value(obj, leaf, full_key, source)
    if dataclasses.is_dataclass(current):
        raise ConfigError(f"{source}: '{full_key}' is a section; set one of its keys, e.g. {full_key}.<key>=...")
    hint = typing.get_type_hints(type(obj))[leaf]
    setattr(obj, leaf, _coerce(value, hint, full_key, source))


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    """Check `value` against the field's type; ints widen to float, nothing else is guessed."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ConfigError(f"{source}: key '{key}': expected {_type_name(hint)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: key '{key}': {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner[:-1]:  # the first type that accepts the value, as declared
            try:
                return _coerce(value, option, key, source)
            except ConfigError:
                pass
        return _coerce(value, inner[-1], key, source)
    if hint is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if hint is float:
        if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads `1e-6` (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise bad
        return value
    if hint is list or origin is list:
        if not isinstance(value, list):
            raise bad
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise bad
        return value
    raise bad


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


SECRET_KEYS = frozenset({"token", "password", "secret", "api_key"})  # leaf names never written out


def flatten(cfg: Any, redact: bool = True) -> dict[str, Any]:
    """{'trainer.lr': 5e-05, ...}; secrets (tokens) are replaced by '***' unless redact=False."""
    flat: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = "***" if redact and v and k in SECRET_KEYS else v

    walk(to_dict(cfg), "")
    return flat


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML, secrets redacted."""
    nested: dict = {}
    for key, value in flatten(cfg).items():
        section, leaf = key.split(".", 1)
        nested.setdefault(section, {})[leaf] = value
    return yaml.safe_dump(nested, sort_keys=False)


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config as YAML (secrets redacted), atomically."""
    return atomic_write_text(path, to_yaml(cfg))


def explain(root: Any, key: str = "") -> str:
    """Every config key of `root` (a `config.Config()`) under `key` ("" = all, a section such as "trainer", or one key) with its
    type, default and help text, read from the schema."""
    lines: list[str] = []

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            dotted, value = f"{prefix}{f.name}", getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{dotted}.")
            elif not key or dotted == key or dotted.startswith(f"{key}."):
                lines.append(f"{dotted} ({_type_name(hints[f.name])}, default {value!r})\n"
                             f"    {f.metadata.get('help', '')}")

    walk(root, "")
    if not lines:
        raise ConfigError(f"unknown key '{key}' (sections: {', '.join(f.name for f in dataclasses.fields(root))})")
    return "\n".join(lines)
