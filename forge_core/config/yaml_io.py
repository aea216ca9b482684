"""YAML parsing for configs with YAML 1.2 scalars and duplicate-key detection.

Under PyYAML's YAML 1.1, `lr: 1e-3` is a string and `wandb_mode: off` a boolean. This loader reads `1e-3` as a
float and only `true`/`false` as booleans, and rejects a key given twice in one mapping.
"""


from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"

# YAML 1.2 core schema: a float has a dot or an exponent (a plain integer stays an int), or is .inf/.nan.
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans and floats, refusing duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"key {key!r} appears twice (first at line {seen[key].line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


ConfigYamlLoader.yaml_implicit_resolvers = {
    first_char: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first_char, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(_BOOL_TAG, _BOOL_RE, list("tTfF"))
ConfigYamlLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """Parse one YAML document with the config rules above; raises yaml.YAMLError on bad syntax."""
    return yaml.load(text, Loader=ConfigYamlLoader)
