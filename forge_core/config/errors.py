"""How a config problem is worded: `ConfigError` and the message for each kind of problem, naming the key, the
value as given (bounded: a YAML alias bomb is never rendered whole) and the fix ("did you mean")."""

from __future__ import annotations

import difflib
import json
import re
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from forge_core.config.introspect import (
    all_key_paths,
    field_types,
    join_key,
    list_element_type,
    literal_values,
    section_of,
)
from forge_core.config.schema import RunConfig


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


def dotted(loc: Sequence[Any]) -> str:
    return ".".join(map(str, loc))


def located(data: Any, loc: Sequence[Any]) -> tuple[list[Any], Any]:
    """The part of `loc` that exists in `data` (pydantic appends union members and the like) and its value."""
    found: list[Any] = []
    for part in loc:
        if isinstance(data, Mapping) and part in data or isinstance(data, list) and isinstance(part, int) and part < len(data):
            found.append(part)
            data = data[part]
        else:
            break
    return found, data


def type_problem(
    data: dict[str, Any], problem: Mapping[str, Any], root: type[BaseModel] = RunConfig
) -> tuple[str, str]:
    """(key, message) for one pydantic error of a `root` model: the key, the value as given, what was expected
    and the fix."""
    loc, value = located(data, problem["loc"])
    key = ".".join(str(p) for p in loc)
    kind = problem["type"]
    section, name = key.rpartition(".")[0], str(loc[-1]) if loc else ""
    if kind == "extra_forbidden":
        owner = section_of(schema_at(loc[:-1], root)[0])
        return key, unknown_key_message(section, name, value, list(field_types(owner)) if owner else [])
    tp, default = schema_at(loc, root)
    if "[key]" in problem["loc"]:
        kind = "invalid_key"
    if kind == "literal_error":
        allowed = literal_values(tp)
        fix = f"use one of {', '.join(repr(a) for a in allowed)}"
        close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1) if isinstance(value, str) else []
        if close:
            fix = f"did you mean {close[0]!r}? ({fix})"
        if isinstance(value, bool):
            fix += "; quote the value in YAML"
        return key, f"{key}={shown(value)}: expected one of {', '.join(repr(a) for a in allowed)}; {fix}"
    if kind == "model_type" and (cls := section_of(tp)) is not None:
        return key, (
            f"{key}={shown(value)}: expected a mapping of {cls.__name__} fields, got {type(value).__name__}; "
            f"write it as `{key}:` followed by indented keys ({', '.join(field_types(cls))})"
        )
    expected, fix = _EXPECTED.get(kind, (None, None))
    if expected is None:
        expected, fix = "valid config data", problem["msg"]
    fix = fix.format(key=key, value=value, example=_example(default, kind), default=json.dumps(_jsonable(default)))
    return key, f"{key}={shown(value)}: expected {expected}, got {type(value).__name__}; {fix}"


# pydantic error type -> (what was expected, the fix; {key}, {value}, {example}, {default} filled in).
_EXPECTED = {
    "int_type": ("an int", "use a whole number, e.g. {key}={example}"),
    "float_type": ("a number", "use a number, e.g. {key}={example}"),
    "finite_number": ("a finite number", "use a finite value (inf/nan are not allowed)"),
    "bool_type": ("a bool", "use true or false"),
    "string_type": ("a string", 'write text, quoted in YAML when it looks like a number, bool or date, e.g. {key}: "{value}"'),
    "list_type": ("a list", "use a YAML list, e.g. {key}: {default}"),
    "dict_type": ("a mapping", "use a YAML mapping, e.g. {key}: {{name: value}}"),
    "invalid_key": ("a mapping with string keys", "quote the keys in YAML"),
    "invalid-json-value": (
        "JSON-like data (null, bool, number, string, list, mapping)",
        "quote it in YAML to keep it as a string",
    ),
}


def schema_at(loc: Sequence[Any], root: type[BaseModel] = RunConfig) -> tuple[Any, Any]:
    """The annotation and the default at `loc` in a `root` model ((None, None) past what the schema knows); a
    list index gives the element type and a fresh element."""
    tp, value = root, _default_of(root)
    for part in loc:
        if isinstance(part, int):
            tp = list_element_type(tp)
            value = _default_of(cls) if (cls := section_of(tp)) is not None else None
        elif (cls := section_of(tp)) is not None and part in cls.model_fields:
            tp, value = field_types(cls)[part], getattr(value, part, None)
        else:
            return None, None
        if tp is None:
            return None, None
    return tp, value


def _default_of(cls: Any) -> Any:
    """A model built from its defaults, or None when some field has no default."""
    try:
        return cls()
    except Exception:  # noqa: BLE001 - a required field: no default to show
        return None


def names_a_rejected_key(path: str, message: str, rejected: Sequence[str]) -> bool:
    """Whether a check message names a key whose value was rejected (and replaced by its default)."""
    for bad_key in rejected:
        names = [bad_key]
        if path and bad_key.startswith(path + "."):
            names.append(bad_key[len(path) + 1 :])
        if any(re.search(rf"(?<![\w.]){re.escape(n)}\s*=", message) for n in names):
            return True
    return False


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


def _example(default: Any, kind: str) -> Any:
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default
    return 1.0 if kind == "float_type" else 1


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


# Keys configs of earlier versions may still carry, with what took their place.
RETIRED_KEYS = {
    "launch.placement": "every stage runs on the run's Ray cluster now (launch.ray_address, an embedded one when "
    "null; launch.<stage>.pool picks labelled nodes); delete the key",
    "rollout.engine_state_dir": "the rollout engines are Ray actors and keep no state folder; delete the key",
    "rdzv_endpoint": "the pipeline arranges every rendezvous on the Ray cluster (one torchrun node per Ray node of "
    "the stage's pool); delete the key",
}


def unknown_key_message(section: str, name: Any, value: Any, fields: Sequence[str]) -> str:
    key = join_key(section, str(name))
    retired = RETIRED_KEYS.get(key) or (RETIRED_KEYS.get(str(name)) if section.startswith("launch.") else None)
    if retired:
        return f"{key}={shown(value)}: no longer a setting; {retired}"
    close = difflib.get_close_matches(str(name), list(fields), n=1, cutoff=0.6)
    elsewhere = [p for p in all_key_paths() if p.rsplit(".", 1)[-1] == name and p != key]
    if close:
        fix = f"did you mean {join_key(section, close[0])!r}?"
    elif elsewhere:
        fix = f"did you mean {' or '.join(repr(p) for p in elsewhere)}? (keys nest under their section)"
    else:
        fix = f"valid keys {'under ' + section if section else 'at the top level'}: {', '.join(fields)}"
    return f"{key}={shown(value)}: unknown key; {fix}"


def qualify(path: str, names: Sequence[str], message: str) -> str:
    """Give a section's check() message its full key: `optimizer.lr=...` under sft -> `sft.optimizer.lr=...`
    (one section class can sit at several places: OptimizerConfig under sft and grpo)."""
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
