"""`skyrl_gym:<env id>`: run an environment of the skyrl-gym library (SkyRL's Gymnasium-style text
environments) through the environment protocol.

    rollout.env: {name: "skyrl_gym:gsm8k_multi_turn", max_turns: 3, kwargs: {observation_template: "\\n{content}\\n"}}
    rollout.rewards: [{name: environment}]          # the environment's reward, summed over the episode

skyrl-gym is a plain in-process, text-in text-out API with light dependencies (it replaces neither torch nor
vLLM's `openai` client). Each episode makes its own environment: `skyrl_gym.make(id, env_config=kwargs.env_config,
extras={"reward_spec": {"ground_truth": ...}, "max_turns": rollout.env.max_turns, "extra_info": {}})`, then
`init([{"role": "user", "content": prompt text}])`. Observation messages are rendered with `observation_template`
(its `{content}`) and joined. A `step` that raises ends its episode with the error recorded. skyrl-gym runs its
tools inside `step`, in this process: a hanging step is bounded only by the stage deadline.
"""

from __future__ import annotations

import importlib.metadata

from forge_core.envs.base import End, Environment, EpisodeState, Observation, Step, check_kwargs
from forge_core.rollout.types import Prompt

PREFIX = "skyrl_gym:"
DISTRIBUTION = "skyrl-gym"
OBSERVATION_TEMPLATE = "\n{content}\n"


class SkyRLEnvironment(Environment):
    def __init__(self, env_id: str, max_turns: int, env_config: dict | None = None,
                 observation_template: str = OBSERVATION_TEMPLATE) -> None:
        try:
            import skyrl_gym
            from skyrl_gym.envs.registration import registry
        except ImportError as exc:
            raise ValueError(
                f"rollout.env.name={PREFIX}{env_id}: needs the {DISTRIBUTION!r} package; run `pip install "
                f"{DISTRIBUTION}` (it is in forgeflow's dev extra)"
            ) from exc
        if env_id not in registry:
            raise ValueError(
                f"rollout.env.name={PREFIX}{env_id}: skyrl-gym has no environment {env_id!r}; it has {sorted(registry)}"
            )
        self.skyrl_gym = skyrl_gym
        self.env_id = env_id
        self.name = PREFIX + env_id
        self.max_turns = max_turns
        self.env_config = dict(env_config or {})
        self.observation_template = observation_template
        self.version = importlib.metadata.version(DISTRIBUTION)

    @classmethod
    def from_config(cls, env) -> SkyRLEnvironment:
        check_kwargs(env.kwargs, ("env_config", "observation_template"), "skyrl_gym environments")
        return cls(env.name.removeprefix(PREFIX), env.max_turns, **env.kwargs)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "package": f"{DISTRIBUTION}=={self.version}",
            "env_config": self.env_config,
            "observation_template": self.observation_template,
        }

    def start(self, prompt: Prompt, sample_index: int) -> EpisodeState:
        extras = {"reward_spec": {"ground_truth": prompt.ground_truth}, "max_turns": self.max_turns, "extra_info": {}}
        env = self.skyrl_gym.make(self.env_id, env_config=self.env_config, extras=extras)
        env.init([{"role": "user", "content": prompt.text}])
        return _SkyRLEpisode(env, self.observation_template)


class _SkyRLEpisode(EpisodeState):
    def __init__(self, env, template: str) -> None:
        self.env = env
        self.template = template
        self.reward = 0.0

    def step(self, model_text: str) -> Step:
        try:
            output = self.env.step(model_text)
        except Exception as exc:  # noqa: BLE001 - a failing environment ends its episode, not the stage
            return End(reward=self.reward, error=f"{type(exc).__name__}: {exc}")
        self.reward += float(output["reward"] or 0.0)
        if output["done"]:
            return End(reward=self.reward)
        messages = output["observations"] or []
        text = "".join(self.template.format(content=m.get("content", "")) for m in messages)
        return Observation(text)

    def close(self) -> None:
        self.env.close()
