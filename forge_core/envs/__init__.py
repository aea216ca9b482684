"""Environments: multi-turn, tool-using episodes for rollouts and evaluation (`rollout.env`).

    env = environment_from_config(cfg.rollout.env)                       # tool_use, skyrl_gym:<id>, or yours
    batch = run_episodes(engine, prompts, env, sampling, seed, encode, episode_limits(cfg.rollout.env))
    batch.episodes    # forge_core.rollout.types.Episode: tokens, model-token mask, per-turn records

The protocol is in base.py, the batched driver in episodes.py; built-in environments are `tool_use`
(tool_env.py, tools.py, parsers.py) and `skyrl_gym:<env id>` (skyrl.py).
"""

from forge_core.envs.base import End, Environment, EpisodeState, Observation, ToolRequest
from forge_core.envs.build import (
    environment_from_config,
    environment_json,
    episode_limits,
    observation_encoder,
)
from forge_core.envs.episodes import EpisodeBatch, EpisodeLimits, episode_metrics, run_episodes
from forge_core.envs.parsers import ParsedTurn, ToolCall, parser_named

__all__ = [
    "End",
    "Environment",
    "EpisodeBatch",
    "EpisodeLimits",
    "EpisodeState",
    "Observation",
    "ParsedTurn",
    "ToolCall",
    "ToolRequest",
    "environment_from_config",
    "environment_json",
    "episode_limits",
    "episode_metrics",
    "observation_encoder",
    "parser_named",
    "run_episodes",
]
