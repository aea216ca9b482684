"""Check a config file or print the config reference.

    python -m forge_core.config check configs/demo_cpu.yaml [key=value ...]   # prints the resolved JSON
    python -m forge_core.config check - [key=value ...]                       # the embedded defaults
    python -m forge_core.config describe                                      # markdown table of every key

`check` exits 2 and lists every problem when the config is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys

from forge_core.config.describe import describe_config
from forge_core.config.loader import ConfigError, config_to_dict, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forge_core.config", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a YAML config with overrides and print it as JSON")
    check.add_argument("path", help="YAML file, or '-' for the embedded defaults")
    check.add_argument("overrides", nargs="*", help="dotted.key=value")
    commands.add_parser("describe", help="print the markdown reference of every config key")
    args = parser.parse_args(argv)
    if args.command == "describe":
        print(describe_config(), end="")
        return 0
    try:
        cfg = load_config(None if args.path == "-" else args.path, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(config_to_dict(cfg), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
