"""Environments: multi-turn, tool-using episodes for rollouts and evaluation (`rollout.env`).

    env = environment_from_config(cfg.rollout.env)                       # tool_use, skyrl_gym:<id>, or yours
    batch = run_episodes(engine, prompts, env, sampling, seed, encode, episode_limits(cfg.rollout.env))
    batch.episodes    # forge_core.rollout.types.Episode: tokens, model-token mask, per-turn records

- base.py      the protocol: Environment.start(row) -> EpisodeState.step(model text) -> Observation | ToolRequest
               | End
- episodes.py  the driver: batched turns through the generation protocol, limits, masks, metrics
- parsers.py   named tool-call parsers (tag, hermes)
- tools.py     tools by name, run in the isolated worker pool with a per-call timeout (the reward workers')
- tool_env.py  `tool_use`: call tools until the model answers
- skyrl.py     `skyrl_gym:<env id>`: environments of the skyrl-gym library
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
