"""What the loader and the reference generator read of the schema: each section's fields and their annotations."""

from __future__ import annotations

import functools
import json
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel

from forge_core.config.schema import RunConfig


@functools.cache
def field_types(cls: type[BaseModel]) -> dict[str, Any]:
    """Field name -> annotation, in declaration order."""
    return {name: info.annotation for name, info in cls.model_fields.items()}


@functools.cache
def all_key_paths() -> tuple[str, ...]:
    """Every dotted key of the schema (list elements as `<list>.0.<field>`), for "did you mean" hints."""

    def walk(cls: type[BaseModel], prefix: str) -> list[str]:
        paths = []
        for name, tp in field_types(cls).items():
            key = join_key(prefix, name)
            paths.append(key)
            nested = section_of(tp) or section_of(list_element_type(tp))
            if nested is not None:
                paths.extend(walk(nested, key if section_of(tp) else key + ".0"))
        return paths

    return tuple(walk(RunConfig, ""))


def section_of(tp: Any) -> type[BaseModel] | None:
    """`tp` when it is a config section class, else None."""
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def list_element_type(tp: Any) -> Any:
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        return element
    return None


def literal_values(tp: Any) -> tuple[Any, ...]:
    """The values a Literal annotation allows (inside an Optional too); () for any other annotation."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return tuple(v for arg in typing.get_args(tp) for v in literal_values(arg))
    return ()


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
