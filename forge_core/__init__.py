"""forgeflow's library: config, storage, launcher, data, models, engine, trainers, losses, rollout, rewards.

It never imports Prefect; `tasks/` and `flows/` build the workflow on top of it.
"""

__version__ = "0.1.0"
