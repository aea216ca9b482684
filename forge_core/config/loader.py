"""Load a `RunConfig` from YAML + command-line overrides, validate all of it at once, and serialise it.

    from forge_core.config import load_config, config_to_json
    cfg = load_config("configs/demo_cpu.yaml", ["sft.steps=50", "rollout.rewards.0.weight=0.5"])
    cfg = load_config(None)          # the embedded defaults (what configs/demo_cpu.yaml spells out)
    python -m forge_core.config check configs/demo_cpu.yaml sft.steps=50   # same, from a shell

Overrides are `dotted.key=value`; the value is parsed as YAML (`seed=3`, `sft.optimizer.lr=1e-3`,
`data.source=s3://bucket/gsm8k.jsonl`, `rollout.sampling.stop=["\\n"]`,
`rollout.rewards=[{"name": "exact_answer", "weight": 0.5}, {"name": "per_digit", "weight": 0.5}]`).
A numeric key part indexes a list (`rollout.rewards.1.weight=0.25`). A mapping value is merged into the
section (`sft={steps: 10}` keeps the other sft keys), any other value replaces the old one.

Validation walks the dataclass tree with `typing.get_type_hints` and collects every problem before raising a
single `ConfigError`: unknown keys (with a "did you mean"), wrong types (an int is accepted for a float field
and stored as a float; a bool is never a number; strings are never converted), then each section's `check()`
and finally `RunConfig.check()`. Checks run on a copy where every rejected value was replaced by its default,
so range rules never compare a string with a number; a check message that names a rejected key is dropped
because the type error already reports that key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import reprlib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from forge_core.config.introspect import (
    all_key_paths,
    dataclass_of,
    field_names,
    field_types,
    join_key,
    list_element_type,
    type_name,
)
from forge_core.config.schema import RunConfig
from forge_core.config.yaml_io import parse_yaml
from forge_core.credentials import scrub_text


class ConfigError(ValueError):
    """Every problem found in one config, each naming the key, the bad value and the fix."""

    def __init__(self, errors: Sequence[str], source: str = "config") -> None:
        self.errors = list(errors)
        self.source = source
        count = len(self.errors)
        header = f"{count} problem{'s' if count != 1 else ''} in {source}:"
        super().__init__("\n".join([header, *(f"  - {e}" for e in self.errors)]))

    def __reduce__(self):
        # Keep `.errors` when the exception crosses a process boundary (Prefect pickles task failures).
        return (type(self), (self.errors, self.source))


# --------------------------------------------------------------------------------------------------------
# Public API


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read `path` (None = the embedded defaults), apply `key=value` overrides, validate, return RunConfig."""
    if isinstance(overrides, str):
        raise TypeError(f"overrides={overrides!r}: pass a list of key=value strings, e.g. [{overrides!r}]")
    overrides = list(overrides)
    source = str(path) if path is not None else "the default config"
    if overrides:
        # The source names the overrides in error messages: never with a URL's credentials in them.
        source += " with overrides " + " ".join(scrub_text(o) for o in overrides)
    raw = _read_yaml_mapping(Path(path)) if path is not None else {}
    errors: list[str] = []
    merged = _merge_onto_defaults(raw, errors)
    for override in overrides:
        merged = _apply_override(merged, override, errors)
    return _build_and_check(merged, errors, source)


def config_from_dict(data: Mapping[str, Any], source: str = "config dict") -> RunConfig:
    """Validate a (possibly partial) nested dict, e.g. the output of `config_to_dict`, into a RunConfig."""
    errors: list[str] = []
    if not isinstance(data, Mapping):
        raise ConfigError(
            [f"{source}: expected a mapping of config sections, got {type(data).__name__}"], source
        )
    return _build_and_check(_merge_onto_defaults(dict(data), errors), errors, source)


def validate_config(cfg: RunConfig) -> RunConfig:
    """Re-validate a RunConfig built or edited in code (e.g. dataclasses.replace); returns a fresh copy."""
    return config_from_dict(config_to_dict(cfg), source="RunConfig")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (the whole RunConfig or any section); a deep copy."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config_to_dict expects a config dataclass instance, got {type(cfg).__name__}")
    return dataclasses.asdict(cfg)


def config_to_json(cfg: Any) -> str:
    """Canonical JSON (sorted keys, no whitespace): equal configs give byte-identical text, for hashing."""
    return json.dumps(
        config_to_dict(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def section_to_dict(cfg: RunConfig, path: str) -> Any:
    """The value at a dotted path as plain data: `section_to_dict(cfg, "sft")`, `(cfg, "grpo.loss")`.

    Per-stage content hashes use it so that a stage's key changes only with the sections the stage reads.
    """
    value: Any = cfg
    walked: list[str] = []
    for part in path.split("."):
        if not dataclasses.is_dataclass(value) or part not in field_names(type(value)):
            where = ".".join(walked) or "RunConfig"
            options = sorted(field_names(type(value))) if dataclasses.is_dataclass(value) else []
            raise KeyError(
                f"config section {path!r}: {where} has no field {part!r}; fields: {', '.join(options)}"
            )
        value = getattr(value, part)
        walked.append(part)
    if dataclasses.is_dataclass(value):
        return config_to_dict(value)
    return json.loads(json.dumps(value))  # plain, detached copy of lists/dicts/scalars


def select_sections(cfg: RunConfig, paths: Iterable[str]) -> dict[str, Any]:
    """`{path: section_to_dict(cfg, path)}` for several paths: the config slice one stage depends on."""
    return {path: section_to_dict(cfg, path) for path in paths}


# --------------------------------------------------------------------------------------------------------
# Reading YAML and applying overrides


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


class _IndexUpdate(dict):
    """`{index: value}` for one element of a list field; made only by overrides like `rewards.0.weight=1`."""


class _KeyUpdate(dict):
    """`{key: value}` for one key named by an override path: it merges even into free-form dict fields
    (`rollout.rewards.0.kwargs.tol=0.1` adds `tol`), whereas a mapping *value* replaces a dict field."""


def _apply_override(merged: dict[str, Any], override: str, errors: list[str]) -> dict[str, Any]:
    key, sep, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        errors.append(f"override {override!r}: expected dotted.key=value, e.g. sft.steps=50")
        return merged
    try:
        value = parse_yaml(text) if text.strip() else None
    except yaml.YAMLError as exc:
        errors.append(
            f"override {override!r}: the value is not valid YAML ({str(exc).splitlines()[0]}); "
            "quote strings with special characters, e.g. name='\"a: b\"'"
        )
        return merged
    update: Any = value
    for part in reversed(parts):
        update = _IndexUpdate({int(part): update}) if part.isdigit() else _KeyUpdate({part: update})
    return _merge(merged, update, RunConfig, "", errors)


def _merge_onto_defaults(raw: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    return _merge(config_to_dict(RunConfig()), raw, RunConfig, "", errors)


def _merge(base: Any, update: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Merge `update` into `base` (plain data): sections merge key by key, other values are replaced.

    Unknown keys are kept so that validation reports them with their value.
    """
    if isinstance(update, _IndexUpdate):
        return _merge_list_element(base, update, tp, key, errors)
    cls = dataclass_of(tp)
    merges_by_key = isinstance(update, _KeyUpdate) or (cls is not None and isinstance(update, Mapping))
    if merges_by_key and isinstance(base, dict):
        hints = field_types(cls) if cls is not None else {}
        merged = dict(base)
        for name, value in update.items():
            if name in base and (cls is None or name in hints):
                merged[name] = _merge(base[name], value, hints.get(name, Any), join_key(key, name), errors)
            else:
                merged[name] = _plain_update(value)
        return merged
    element_cls = dataclass_of(list_element_type(tp))
    if element_cls is not None and isinstance(update, list):
        element_default = config_to_dict(element_cls())
        return [
            _merge(element_default, item, element_cls, join_key(key, str(i)), errors)
            for i, item in enumerate(update)
        ]
    return _plain_update(update)


def _plain_update(value: Any) -> Any:
    """An override path that leads nowhere (an unknown or new key) becomes plain nested dicts."""
    if isinstance(value, (_KeyUpdate, _IndexUpdate)):
        return {k: _plain_update(v) for k, v in value.items()}
    return value


def _merge_list_element(base: Any, update: _IndexUpdate, tp: Any, key: str, errors: list[str]) -> Any:
    ((index, value),) = update.items()
    if not isinstance(base, list):
        errors.append(
            f"{join_key(key, str(index))}: {key or 'the config'} is not a list, so it has no element {index}"
        )
        return base
    if index >= len(base):
        errors.append(
            f"{join_key(key, str(index))}: index out of range, {key} has {len(base)} element(s); "
            f"set the whole list instead, e.g. {key}=[...]"
        )
        return base
    merged = list(base)
    merged[index] = _merge(base[index], value, list_element_type(tp), join_key(key, str(index)), errors)
    return merged


# --------------------------------------------------------------------------------------------------------
# Validation: types and unknown keys, then each section's check()


@dataclasses.dataclass
class _Walk:
    """What a validation pass collects: messages, keys with a wrong type, and built sections to check."""

    errors: list[str]
    type_error_keys: list[str] = dataclasses.field(default_factory=list)
    sections: list[tuple[str, Any]] = dataclasses.field(default_factory=list)

    def type_error(self, key: str, message: str) -> None:
        self.errors.append(message)
        self.type_error_keys.append(key)

    def mentions_bad_value(self, path: str, message: str) -> bool:
        """True if a check message names a key whose value was rejected (and replaced by its default)."""
        for bad_key in self.type_error_keys:
            names = [bad_key]
            if path and bad_key.startswith(path + "."):
                names.append(bad_key[len(path) + 1 :])
            if any(re.search(rf"(?<![\w.]){re.escape(n)}\s*=", message) for n in names):
                return True
        return False


_INVALID = object()


def _build_and_check(merged: dict[str, Any], errors: list[str], source: str) -> RunConfig:
    walk = _Walk(errors)
    cfg = _build_dataclass(RunConfig, merged, "", RunConfig(), walk)
    for path, section in walk.sections:
        walk.errors.extend(m for m in _run_check(path, section) if not walk.mentions_bad_value(path, m))
    if walk.errors:
        raise ConfigError(walk.errors, source)
    return cfg


def _build_dataclass(cls: type, data: Any, key: str, default: Any, walk: _Walk) -> Any:
    if not isinstance(data, Mapping):
        walk.type_error(
            key,
            f"{key}={data!r}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}; "
            f"write it as `{key}:` followed by indented keys ({', '.join(field_names(cls))})",
        )
        return _INVALID
    hints = field_types(cls)
    for name in data:
        if name not in hints:
            walk.errors.append(_unknown_key_message(key, name, data[name], hints))
    kwargs = {}
    for name, tp in hints.items():
        field_default = getattr(default, name)
        if name not in data:
            kwargs[name] = _fresh(field_default)
            continue
        value = _convert(tp, data[name], join_key(key, name), field_default, walk)
        kwargs[name] = _fresh(field_default) if value is _INVALID else value
    instance = cls(**kwargs)
    walk.sections.append((key, instance))
    return instance


def _convert(tp: Any, value: Any, key: str, default: Any, walk: _Walk) -> Any:
    """Return `value` checked against annotation `tp` (ints widened to float), or _INVALID after reporting."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, key, default if isinstance(default, tp) else tp(), walk)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, key, default, walk)
    if origin is Literal:
        return _convert_literal(tp, value, key, walk)
    if tp is list or origin is list:
        return _convert_list(tp, value, key, default, walk)
    if tp is dict or origin is dict:
        return _convert_dict(tp, value, key, walk)
    if tp is bool:
        return value if isinstance(value, bool) else _report(walk, key, value, "a bool", "use true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return _report(walk, key, value, "an int", f"use a whole number, e.g. {key}={_example(default, 1)}")
    if tp is float:
        return _convert_float(value, key, default, walk)
    if tp is str:
        if isinstance(value, str):
            return value
        return _report(
            walk,
            key,
            value,
            "a string",
            f'write text, quoted in YAML when it looks like a number, bool or date, e.g. {key}: "{value}"',
        )
    if tp is Any or tp is object:
        return _convert_plain_data(value, key, walk)
    raise TypeError(f"config field {key}: unsupported annotation {tp!r} in forge_core/config/schema.py")


def _convert_float(value: Any, key: str, default: Any, walk: _Walk) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _report(walk, key, value, "a number", f"use a number, e.g. {key}={_example(default, 1.0)}")
    if not math.isfinite(value):
        return _report(walk, key, value, "a finite number", "use a finite value (inf/nan are not allowed)")
    return float(value)


def _convert_union(tp: Any, value: Any, key: str, default: Any, walk: _Walk) -> Any:
    options = typing.get_args(tp)
    if value is None and type(None) in options:
        return None
    non_null = [o for o in options if o is not type(None)]
    for option in non_null:
        trial = _Walk([])
        converted = _convert(option, value, key, default, trial)
        if converted is not _INVALID and not trial.errors:
            walk.sections.extend(trial.sections)
            return converted
    if len(non_null) == 1:
        return _convert(non_null[0], value, key, default, walk)
    expected = " or ".join(type_name(o) for o in options)
    return _report(walk, key, value, expected, f"use {expected}")


def _convert_literal(tp: Any, value: Any, key: str, walk: _Walk) -> Any:
    allowed = typing.get_args(tp)
    if any(value == a and type(value) is type(a) for a in allowed):
        return value
    fix = f"use one of {', '.join(repr(a) for a in allowed)}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1)
        if close:
            fix = f"did you mean {close[0]!r}? ({fix})"
    if isinstance(value, bool):
        fix += "; quote the value in YAML"
    return _report(walk, key, value, f"one of {', '.join(repr(a) for a in allowed)}", fix, show_type=False)


def _convert_list(tp: Any, value: Any, key: str, default: Any, walk: _Walk) -> Any:
    if not isinstance(value, list):
        return _report(
            walk, key, value, "a list", f"use a YAML list, e.g. {key}: {json.dumps(_plain(default))}"
        )
    element_tp = list_element_type(tp)
    if element_tp is None:
        return _convert_plain_data(value, key, walk)
    element_cls = dataclass_of(element_tp)
    converted = []
    for i, item in enumerate(value):
        element_default = element_cls() if element_cls is not None else None
        converted.append(_convert(element_tp, item, join_key(key, str(i)), element_default, walk))
    return _INVALID if any(c is _INVALID for c in converted) else converted


def _convert_dict(tp: Any, value: Any, key: str, walk: _Walk) -> Any:
    if not isinstance(value, Mapping):
        return _report(walk, key, value, "a mapping", f"use a YAML mapping, e.g. {key}: {{name: value}}")
    args = typing.get_args(tp)
    value_tp = args[1] if len(args) == 2 else Any
    converted = {}
    for name, item in value.items():
        if not isinstance(name, str):
            return _report(walk, key, value, "a mapping with string keys", f"quote the key {name!r} in YAML")
        converted[name] = _convert(value_tp, item, join_key(key, name), None, walk)
    return _INVALID if any(c is _INVALID for c in converted.values()) else converted


def _convert_plain_data(value: Any, key: str, walk: _Walk) -> Any:
    """Free-form values (e.g. reward kwargs) must be JSON data: the config hashes and round-trips exactly."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _convert_float(value, key, None, walk)
    if isinstance(value, list):
        items = [_convert_plain_data(v, join_key(key, str(i)), walk) for i, v in enumerate(value)]
        return _INVALID if any(i is _INVALID for i in items) else items
    if isinstance(value, Mapping):
        return _convert_dict(dict, value, key, walk)
    return _report(
        walk,
        key,
        value,
        "JSON-like data (null, bool, number, string, list, mapping)",
        "quote it in YAML to keep it as a string",
    )


def shown(value: Any) -> str:
    """`value` as an error message shows it: a repr bounded in depth, items and length, so that a value built
    from YAML aliases (a few hundred bytes that expand to billions of items) is not rendered whole."""
    return _BOUNDED_REPR.repr(value)


def _bounded_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxstring, bounded.maxother = 2, 120, 120
    bounded.maxtuple = bounded.maxlist = bounded.maxdict = bounded.maxset = 6
    return bounded


_BOUNDED_REPR = _bounded_repr()


def _report(walk: _Walk, key: str, value: Any, expected: str, fix: str, show_type: bool = True) -> Any:
    got = f", got {type(value).__name__}" if show_type else ""
    walk.type_error(key, f"{key}={shown(value)}: expected {expected}{got}; {fix}")
    return _INVALID


# Keys configs of earlier versions may still carry, with what took their place.
RETIRED_KEYS = {
    "launch.placement": "every stage runs on the run's Ray cluster now (launch.ray_address, an embedded one when "
    "null; launch.<stage>.pool picks labelled nodes); delete the key",
    "rollout.engine_state_dir": "the rollout engines are Ray actors and keep no state folder; delete the key",
    "rdzv_endpoint": "the pipeline arranges every rendezvous on the Ray cluster (one torchrun node per Ray node of "
    "the stage's pool); delete the key",
}


def _unknown_key_message(section: str, name: Any, value: Any, hints: Mapping[str, Any]) -> str:
    key = join_key(section, str(name))
    retired = RETIRED_KEYS.get(key) or (RETIRED_KEYS.get(str(name)) if section.startswith("launch.") else None)
    if retired:
        return f"{key}={shown(value)}: no longer a setting; {retired}"
    close = difflib.get_close_matches(str(name), list(hints), n=1, cutoff=0.6)
    elsewhere = [p for p in all_key_paths() if p.rsplit(".", 1)[-1] == name and p != key]
    if close:
        fix = f"did you mean {join_key(section, close[0])!r}?"
    elif elsewhere:
        fix = f"did you mean {' or '.join(repr(p) for p in elsewhere)}? (keys nest under their section)"
    else:
        fix = f"valid keys {'under ' + section if section else 'at the top level'}: {', '.join(hints)}"
    return f"{key}={shown(value)}: unknown key; {fix}"


def _run_check(path: str, section: Any) -> list[str]:
    check = getattr(section, "check", None)
    if check is None:
        return []
    try:
        messages = check()
    except Exception as exc:  # noqa: BLE001 - a rule that crashes must not hide the other problems
        message = (
            f"{path or 'config'}: {type(section).__name__}.check() failed on these values ({exc!r}); "
            "fix the values it names or report the bug"
        )
        return [message]
    names = field_names(type(section))
    return [_qualify(path, names, m) for m in messages]


def _qualify(path: str, names: Sequence[str], message: str) -> str:
    """Give a section's check() message its full key: `optimizer.lr=...` under sft -> `sft.optimizer.lr=...`.

    Sections may name keys relative to themselves because one dataclass can sit at several places
    (OptimizerConfig under sft and grpo, ResourceConfig under every launch.<stage>).
    """
    if not path or message.startswith((path + ".", path + "=")):
        return message
    parts = path.split(".")
    for start in range(1, len(parts)):
        suffix = ".".join(parts[start:])
        if message.startswith((suffix + ".", suffix + "=")):
            return ".".join(parts[:start]) + "." + message
    if any(message.startswith((name + "=", name + ".")) for name in names):
        return f"{path}.{message}"
    return f"{path}: {message}"


# --------------------------------------------------------------------------------------------------------
# Small helpers


def _fresh(value: Any) -> Any:
    """A default value that no other config instance shares (lists, dicts, sections are mutable)."""
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{n: _fresh(getattr(value, n)) for n in field_names(type(value))})
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return config_to_dict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _example(default: Any, fallback: Any) -> Any:
    return default if isinstance(default, (int, float)) and not isinstance(default, bool) else fallback
