"""Introspection of the config dataclasses shared by the loader and the reference generator."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any, Literal, Union

from forge_core.config.schema import RunConfig


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in declaration order (schema.py uses postponed annotations)."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def all_key_paths() -> tuple[str, ...]:
    """Every dotted key of the schema (list elements as `<list>.0.<field>`), for "did you mean" hints."""

    def walk(cls: type, prefix: str) -> list[str]:
        paths = []
        for name, tp in field_types(cls).items():
            key = join_key(prefix, name)
            paths.append(key)
            nested = dataclass_of(tp) or dataclass_of(list_element_type(tp))
            if nested is not None:
                paths.extend(walk(nested, key if dataclass_of(tp) else key + ".0"))
        return paths

    return tuple(walk(RunConfig, ""))


def field_names(cls: type) -> list[str]:
    return list(field_types(cls))


def dataclass_of(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def list_element_type(tp: Any) -> Any:
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        return element
    return None


def type_name(tp: Any) -> str:
    """Readable annotation: `int`, `str | null`, `"cosine" | "linear"`, `list[RewardComponentConfig]`."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(list_element_type(tp))}]"
    if tp is dict or origin is dict:
        return "mapping"
    if tp is list:
        return "list"
    return getattr(tp, "__name__", str(tp))


def join_key(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name
