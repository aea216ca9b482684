"""The environment a run's config names (`rollout.env`), and the observation encoder of a policy's tokenizer.

    env = environment_from_config(cfg.rollout.env)      # None when rollout.env.name is null (single-turn)
    encode = observation_encoder(policy.local_dir)       # text -> token ids, no special tokens
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from forge_core.config.schema import EnvironmentConfig
from forge_core.envs.base import Environment
from forge_core.envs.episodes import EpisodeLimits
from forge_core.envs.skyrl import PREFIX as SKYRL_PREFIX
from forge_core.envs.skyrl import SkyRLEnvironment
from forge_core.envs.tool_env import ToolUseEnvironment

_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def environment_from_config(
    env: EnvironmentConfig, worker_env_allow: Sequence[str] = ()
) -> Environment | None:
    """The configured environment, or None when disabled; `worker_env_allow`: extra variables its tool workers
    get. ValueError naming `rollout.env.name` and the fix."""
    if not env.enabled:
        return None
    if env.name == ToolUseEnvironment.name:
        return ToolUseEnvironment.from_config(env, worker_env_allow)
    if env.name.startswith(SKYRL_PREFIX):
        return SkyRLEnvironment.from_config(env)
    if _FACTORY_RE.match(env.name):
        return _user_environment(env)
    raise ValueError(
        f"rollout.env.name={env.name!r}: unknown; use tool_use, {SKYRL_PREFIX}<env id> (e.g. "
        f"{SKYRL_PREFIX}gsm8k_multi_turn) or your own factory 'package.module:function'"
    )


def _user_environment(env: EnvironmentConfig) -> Environment:
    module_name, attr = env.name.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rollout.env.name={env.name!r}: cannot import it ({exc})") from exc
    built = factory(env)
    if not isinstance(built, Environment):
        raise ValueError(  # noqa: TRY004 - a config error, fatal like every ValueError
            f"rollout.env.name={env.name!r} returned a {type(built).__name__}; an environment factory takes the "
            "rollout.env section and returns a forge_core.envs.Environment"
        )
    return built


def episode_limits(env: EnvironmentConfig) -> EpisodeLimits:
    return EpisodeLimits(max_turns=env.max_turns, max_total_tokens=env.max_total_tokens)


def environment_json(env: Environment, cfg: EnvironmentConfig) -> str:
    """What every episode row records about its environment (lineage): its description and the limits."""
    record = {**env.describe(), "max_turns": cfg.max_turns, "max_total_tokens": cfg.max_total_tokens,
              "tool_timeout_s": cfg.tool_timeout_s}
    return json.dumps(record, sort_keys=True)


def observation_encoder(policy_dir: str | Path) -> Callable[[str], list[int]]:
    """Encodes observation text with the policy's tokenizer.json, no special tokens; ValueError if it has none."""
    from tokenizers import Tokenizer

    path = Path(policy_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"policy folder {policy_dir}: no tokenizer.json to encode environment observations with")
    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids if text else []
