"""Markdown reference and JSON schema of every config key, generated from schema.py (types, defaults and field
comments).

    python -m forge_core.config describe > docs/config-reference.md
    config_json_schema()                    # docs/config.schema.json: editors validate YAML configs with it

Descriptions are the `#` comments above (or after) each field in schema.py, so a key is documented in one place.
"""


from __future__ import annotations

import ast
import functools
import inspect
import io
import json
import textwrap
import tokenize
from typing import Any

from pydantic import BaseModel

from forge_core.config.introspect import field_types, list_element_type, section_of, type_name
from forge_core.config.schema import RunConfig


def describe_config() -> str:
    """One markdown table per top-level section: key, type, default, description."""
    default = RunConfig()
    scalar_rows = []
    blocks = []
    for name, tp in field_types(RunConfig).items():
        value = getattr(default, name)
        section_cls = section_of(tp)
        if section_cls is None:
            scalar_rows.extend(_rows(RunConfig, name, tp, value, name))
            continue
        heading = f"### `{name}`"
        doc = _class_doc(section_cls)
        rows = _section_rows(section_cls, value, name)
        blocks.append("\n".join([heading, "", *([doc, ""] if doc else []), _table(rows)]))
    top = "\n".join(["### top level", "", _table(scalar_rows)])
    return "\n\n".join([top, *blocks]) + "\n"


def config_json_schema(root: type[BaseModel] = RunConfig) -> dict[str, Any]:
    """The JSON schema of a run config or another root section model (pydantic's, draft 2020-12), every key
    described by the comment above its field."""
    schema = root.model_json_schema()
    for cls in _section_classes(root):
        where = schema if cls is root else schema["$defs"][cls.__name__]
        for name, text in field_help(cls).items():
            if text:
                where["properties"][name]["description"] = text
    return schema


def _section_classes(cls: type[BaseModel]) -> list[type[BaseModel]]:
    found = [cls]
    for tp in field_types(cls).values():
        nested = section_of(tp) or section_of(list_element_type(tp))
        if nested is not None and nested not in found:
            found += [c for c in _section_classes(nested) if c not in found]
    return found


def _section_rows(cls: type, value: Any, prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, tp in field_types(cls).items():
        rows.extend(_rows(cls, name, tp, getattr(value, name), f"{prefix}.{name}"))
    return rows


def _rows(owner: type, name: str, tp: Any, value: Any, key: str) -> list[tuple[str, str, str, str]]:
    nested = section_of(tp)
    if nested is not None:
        return _section_rows(nested, value, key)
    rows = [(key, type_name(tp), _default_text(value), field_help(owner).get(name, ""))]
    element_cls = section_of(list_element_type(tp))
    if element_cls is not None:
        # Document the element fields with the element class's own defaults, as `<list>.<i>.<field>`.
        rows.extend(_section_rows(element_cls, element_cls(), f"{key}.<i>"))
    return rows


def _default_text(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, list):
        value = [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
    return f"`{json.dumps(value)}`"


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, type_text, default, help_text in rows:
        cells = [f"`{key}`", f"`{type_text}`", default, help_text]
        lines.append("| " + " | ".join(_escape_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _class_doc(cls: type) -> str:
    return inspect.cleandoc(cls.__dict__.get("__doc__") or "")


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Field name -> the comment block directly above it plus any comment at the end of its line."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped (e.g. a zipped install): types and defaults only
        return {}
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    (class_node,) = ast.parse(source).body
    help_by_field = {}
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = [comments[node.end_lineno]] if node.end_lineno in comments else []
        help_by_field[node.target.id] = " ".join(above + trailing)
    return help_by_field
