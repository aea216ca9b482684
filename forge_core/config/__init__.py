"""forgeflow's typed run configuration: schema, YAML loading with overrides, validation, serialisation.

from forge_core.config import load_config
cfg = load_config("configs/demo_cpu.yaml", ["sft.steps=50"])   # raises ConfigError listing every problem
python -m forge_core.config check configs/demo_cpu.yaml sft.steps=50
python -m forge_core.config describe        # markdown reference of every key
"""

from forge_core.config.describe import describe_config
from forge_core.config.loader import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_json,
    load_config,
    load_model,
    model_from_dict,
    replace,
    section_to_dict,
    select_sections,
    validate_config,
)
from forge_core.config.schema import RunConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_json",
    "describe_config",
    "load_config",
    "load_model",
    "model_from_dict",
    "replace",
    "section_to_dict",
    "select_sections",
    "validate_config",
]
