"""Load a `RunConfig` from YAML + command-line overrides, validate all of it at once, and serialise it.

    cfg = load_config("configs/demo_cpu.yaml", ["sft.steps=50", "rollout.rewards.0.weight=0.5"])
    cfg = load_config(None)          # the embedded defaults

Overrides are `dotted.key=value` with a YAML value; a numeric key part indexes a list. A mapping value merges
into the section (`sft={steps: 10}` keeps the other sft keys); any other value replaces the old one. Every
problem comes back in one `ConfigError`: type and unknown-key errors, then every section's `check()`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from forge_core.config.errors import (
    ConfigError,
    dotted,
    located,
    names_a_rejected_key,
    qualify,
    schema_at,
    type_problem,
)
from forge_core.config.introspect import (
    field_types,
    join_key,
    section_of,
)
from forge_core.config.schema import RunConfig, Section
from forge_core.config.yaml_io import parse_yaml
from forge_core.credentials import scrub_text

SectionT = TypeVar("SectionT", bound=Section)
ModelT = TypeVar("ModelT", bound=BaseModel)


# ---- public API -------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read `path` (None = the embedded defaults), apply `key=value` overrides, validate, return RunConfig.

    Raises:
        ConfigError: every problem of the file and the overrides at once.
        TypeError: `overrides` is one string instead of a list of them.
    """
    return load_model(RunConfig, path, overrides)


def load_model(root: type[ModelT], path: str | Path | None, overrides: Iterable[str] = ()) -> ModelT:
    """`load_config` for any root section model (a run config, a drill plan): read `path` (None = the
    model's defaults), apply `key=value` overrides, validate everything at once.

    Raises:
        ConfigError: every problem of the file and the overrides at once.
        TypeError: `overrides` is one string instead of a list of them.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides={overrides!r}: pass a list of key=value strings, e.g. [{overrides!r}]")
    overrides = list(overrides)
    source = str(path) if path is not None else "the default config"
    if overrides:
        # The source names the overrides in error messages: never with a URL's credentials in them.
        source += " with overrides " + " ".join(scrub_text(o) for o in overrides)
    errors: list[str] = []
    data = _read_yaml_mapping(Path(path)) if path is not None else {}
    for override in overrides:
        data = _apply_override(data, override, errors, root)
    return _build_and_check(data, errors, source, root)


def config_from_dict(data: Mapping[str, Any], source: str = "config dict") -> RunConfig:
    """Validate a (possibly partial) nested dict, e.g. the output of `config_to_dict`, into a RunConfig."""
    if not isinstance(data, Mapping):
        raise ConfigError([f"{source}: expected a mapping of config sections, got {type(data).__name__}"], source)
    return _build_and_check(dict(data), [], source)


def validate_config(cfg: RunConfig) -> RunConfig:
    """Validate a RunConfig built or changed in code (e.g. with `replace`); returns a fresh copy."""
    return config_from_dict(config_to_dict(cfg), source="RunConfig")


def replace(section: SectionT, **changes: Any) -> SectionT:
    """A copy of a config section with `changes`, unvalidated (`validate_config` checks a whole config)."""
    return section.model_copy(update=changes)


def config_to_dict(cfg: Section) -> dict[str, Any]:
    """Plain nested dict of a config section (the whole RunConfig or any part); a deep copy."""
    if not isinstance(cfg, BaseModel):
        raise TypeError(f"config_to_dict expects a config section, got {type(cfg).__name__}")
    return cfg.model_dump(warnings=False)


def config_to_json(cfg: Section) -> str:
    """Canonical JSON (sorted keys, no whitespace): equal configs give byte-identical text, for hashing."""
    return json.dumps(config_to_dict(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def section_to_dict(cfg: RunConfig, path: str) -> Any:
    """The value at a dotted path (`"sft"`, `"grpo.loss"`) as a detached plain copy.

    Raises:
        KeyError: the path names no field, with the fields there are.
    """
    value: Any = cfg
    walked: list[str] = []
    for part in path.split("."):
        fields = list(type(value).model_fields) if isinstance(value, BaseModel) else []
        if part not in fields:
            where = ".".join(walked) or "RunConfig"
            raise KeyError(f"config section {path!r}: {where} has no field {part!r}; fields: {', '.join(sorted(fields))}")
        value = getattr(value, part)
        walked.append(part)
    if isinstance(value, BaseModel):
        return config_to_dict(value)
    return json.loads(json.dumps(value))  # plain, detached copy of lists/dicts/scalars


def select_sections(cfg: RunConfig, paths: Iterable[str]) -> dict[str, Any]:
    """`{path: section_to_dict(cfg, path)}` for several paths: the config slice one stage depends on."""
    return {path: section_to_dict(cfg, path) for path in paths}


# ---- YAML and overrides -----------------------------------------------------------------------------------


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        siblings = sorted(p.name for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f"; configs next to it: {', '.join(siblings)}" if siblings else "; see configs/*.yaml"
        raise ConfigError([f"{path}: no such config file{hint}"], str(path))
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: invalid YAML: {exc}"], str(path)) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"{path}: the top level must be a mapping of sections (e.g. `sft:`), got {type(data).__name__}"],
            str(path),
        )
    return data


class _BadOverride(ValueError):
    """An override whose path cannot be followed (an index past a list's end, an index into a non-list)."""


def _apply_override(
    data: dict[str, Any], override: str, errors: list[str], root: type[BaseModel] = RunConfig
) -> dict[str, Any]:
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p for p in parts):
        errors.append(f"override {override!r}: expected dotted.key=value, e.g. sft.steps=50")
        return data
    try:
        value = parse_yaml(text) if text.strip() else None
    except yaml.YAMLError as exc:
        errors.append(
            f"override {override!r}: the value is not valid YAML ({str(exc).splitlines()[0]}); "
            "quote strings with special characters, e.g. name='\"a: b\"'"
        )
        return data
    try:
        return _set(data, [int(p) if p.isdigit() else p for p in parts], value, [], root)
    except _BadOverride as exc:
        errors.append(str(exc))
        return data


def _set(data: Any, parts: list[Any], value: Any, walked: list[Any], root: type[BaseModel]) -> Any:
    """A copy of `data` with `value` at `parts`, copying only along the path."""

    head, rest, here = parts[0], parts[1:], [*walked, parts[0]]
    if isinstance(head, int):
        data = data if data is not None else schema_at(walked, root)[1]
        where = ".".join(map(str, walked))
        if not isinstance(data, list):
            raise _BadOverride(f"{dotted(here)}: {where or 'the config'} is not a list, so it has no element {head}")
        if head >= len(data):
            raise _BadOverride(
                f"{dotted(here)}: index out of range, {where} has {len(data)} element(s); set the whole list instead, "
                f"e.g. {where}=[...]"
            )
        copy: Any = [_plain(item) for item in data]
    else:
        copy = dict(data) if isinstance(data, Mapping) else {}
        if head not in copy and rest:
            copy[head] = _plain(schema_at(here, root)[1])
    copy[head] = (
        _set(copy[head], rest, value, here, root) if rest else _merged(copy.get(head), value, schema_at(here, root)[0])
    )
    return copy


def _merged(old: Any, value: Any, tp: Any) -> Any:
    """`value` set over `old`: merged key by key into a section, replacing anything else (a free-form mapping too)."""
    cls = section_of(tp)
    if cls is None or not isinstance(old, Mapping) or not isinstance(value, Mapping):
        return value
    types = field_types(cls)
    return {**old, **{k: _merged(old.get(k), v, types.get(k)) for k, v in value.items()}}


def _plain(value: Any) -> Any:
    return config_to_dict(value) if isinstance(value, BaseModel) else value


# ---- validation -------------------------------------------------------------------------------------------


def model_from_dict(root: type[ModelT], data: Any, source: str) -> ModelT:
    """Validate `data` into a `root` section model (a run config, a drill plan) with every problem worded as
    `load_config` words it, all at once.

    Raises:
        ConfigError: every type, unknown-key and `check()` problem.
    """
    if not isinstance(data, Mapping):
        raise ConfigError([f"{source}: expected a mapping of {root.__name__} fields, got {type(data).__name__}"], source)
    return _build_and_check(dict(data), [], source, root)


def _build_and_check(data: dict[str, Any], errors: list[str], source: str, root: type[ModelT] = RunConfig) -> ModelT:
    rejected: list[str] = []
    try:
        cfg = root.model_validate(data)
    except ValidationError as exc:
        problems = exc.errors(include_url=False)
        for problem in problems:
            key, message = type_problem(data, problem, root)
            if message not in errors:
                errors.append(message)
                rejected.append(key)
        try:  # the checks run on what is left: every rejected value back at its default
            cfg = root.model_validate(_without(data, problems))
        except ValidationError:
            raise ConfigError(errors, source) from None
    for path, section in _sections(cfg, ""):
        errors.extend(m for m in _run_check(path, section) if not names_a_rejected_key(path, m, rejected))
    if errors:
        raise ConfigError(errors, source)
    return cfg


def _sections(section: BaseModel, path: str) -> Iterator[tuple[str, BaseModel]]:
    """Every section under `section` (list elements too), innermost first, then itself: RunConfig last."""
    for name in type(section).model_fields:
        value = getattr(section, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                yield from _sections(item, join_key(path, f"{name}.{i}" if isinstance(value, list) else name))
    yield path, section


def _without(data: Any, problems: Sequence[Mapping[str, Any]]) -> Any:
    """`data` with each problem's key removed, so its default takes its place. Copies only the containers
    along those keys: a rejected value may be a YAML alias bomb, never to be walked whole."""

    for problem in problems:
        loc, _ = located(data, problem["loc"])
        named = [i for i, part in enumerate(loc) if isinstance(part, str)]
        if named:  # the innermost named key: a bad list element drops the whole list
            data = _dropped(data, loc[: named[-1] + 1])
    return data


def _dropped(data: Any, loc: Sequence[Any]) -> Any:
    copy = dict(data) if isinstance(data, Mapping) else list(data)
    if len(loc) == 1:
        copy.pop(loc[0], None)
    else:
        copy[loc[0]] = _dropped(data[loc[0]], loc[1:])
    return copy


def _run_check(path: str, section: Any) -> list[str]:
    try:
        messages = section.check()
    except Exception as exc:  # noqa: BLE001 - a rule that crashes must not hide the other problems
        failed = f"{path or 'config'}: {type(section).__name__}.check() failed on these values ({exc!r})"
        return [f"{failed}; fix the values it names or report the bug"]
    return [qualify(path, list(type(section).model_fields), m) for m in messages]


