"""The long-lived rollout engine: one vLLM `Generator` in a service process that outlives the stages using it.

A stage-per-iteration loop pays a vLLM start-up (tens of seconds on CPU) in every rollout and evaluate stage;
this service pays it once per flow run and loads each new policy in place (`Generator.reload`, milliseconds
for small models). Stage code uses it through the generation protocol (forge_core.rollout.protocol):

    client = EngineService.ensure(state_dir, cfg.rollout, policy.local_dir, policy.version)
    samples = client.generate(prompts, cfg.rollout.sampling, seed=7)   # refused unless it serves policy.version
    client.close()                               # disconnects; the service keeps running
    ...
    stop_services(state_dir)                     # the flow, at its end and on failure/cancellation

or by hand: `python -m forge_core.rollout.service --state-dir D --policy-dir P --policy-version V ...` (what
`ensure` runs; see `server.main`).

Several engines (`rollout.num_engines: N > 1`): `EngineService.ensure_engines(state_dir, rollout, policy_dir,
policy_version)` keeps N services `engine-0` .. `engine-<N-1>` (one vLLM engine each, on its own cores or GPUs:
pool.replica_layouts) and returns them behind one `EngineRouter` (forge_core.rollout.router, the router the
stage-lifetime replica pool uses too): it splits prompts across the live engines and re-routes a dead engine's
prompts to the others (per-prompt seeds: the samples do not change); the next `ensure_engines` restarts the
dead one. With N = 1 it is the one service `rollout`.

Modules: `state` (the state folder, records, errors: both sides), `connection` (EngineClient: the socket, the
key challenge, request/reply, the version every request carries), `supervision` (EngineService, stop_services:
starting, waiting for ready, restarting, stopping), `server` (the service process). Import the public names
from here.

Requests: `ping` -> {pid, policy_version, uptime_s, ...}; `load(policy_dir, policy_version)` -> reloads the
weights in place and records the version (no-op when that version is already served); `generate(prompts,
seed, sampling, expected_version)` -> samples, refused with `PolicyVersionMismatch` when the engine serves
another version (never silently the wrong policy); `shutdown`.

Channel: `multiprocessing.connection` on a Unix socket in the state folder. No TCP port to pick, collide on
or expose; access is limited by file permissions (folder 0700, socket 0600) plus an HMAC challenge with a
32-byte key in `<state_dir>/authkey` (0600), so only this user's processes that can read the key get in;
token-id lists and `Sample`s travel as pickles (no HTTP/JSON encoding of every token, no tokenizer round
trip as with vLLM's OpenAI server). Pickle is safe here because every peer has passed the key challenge.

State folder `<state_dir>` (one flow run's engines; several services by `name`):
  `<name>.sock`  the socket, `<name>.json`  the service record (pid, start time, launch id, status
  starting/ready/failed, what it serves), `<name>.log`  its stdout/stderr, `<name>.lock`  serialises
  start-ups, `authkey`.

Process ownership: the service runs in its own session with its own FORGE_LAUNCH_ID and writes a launch
registry record (forge_core.launch.registry) whose owner is the process that bounds its life: the flow
process that launched the stage worker calling `ensure` (the worker's FORGE_LAUNCH_OWNER), else the caller.
So the service stops by itself within about a second of its owner's death (forge_core.launch.owner; the stop
is bounded: server.py), `reap_orphaned_launches()` ends what is left of it, and the stage's launcher leaves it
alone (process_tree skips descendants of another launch). vLLM's processes started by the service carry its
launch id, so `stop_services` finds them.

Requests touching the engine run one at a time on the service's main thread (vLLM is not shared across
threads); `ping` is answered by the connection's thread, also while a generation runs. After an unexpected
engine error (e.g. vLLM's EngineDeadError) the service replies and exits: the next `ensure` (the stage's
retry) starts a new one.
"""

from forge_core.rollout.protocol import PolicyVersionMismatch
from forge_core.rollout.router import EngineRouter
from forge_core.rollout.service.connection import EngineClient, healthy_client
from forge_core.rollout.service.server import main
from forge_core.rollout.service.state import (
    DEFAULT_NAME,
    MODULE,
    EngineServiceError,
    ServicePaths,
    ServiceRecord,
    check_private,
    log_tail,
    prepare_state_dir,
    read_record,
    write_record,
)
from forge_core.rollout.service.supervision import (
    EngineService,
    end_stale_service,
    engine_names,
    service_environment,
    stop_services,
)

__all__ = [
    "DEFAULT_NAME",
    "MODULE",
    "EngineClient",
    "EngineRouter",
    "EngineService",
    "EngineServiceError",
    "PolicyVersionMismatch",
    "ServicePaths",
    "ServiceRecord",
    "check_private",
    "end_stale_service",
    "engine_names",
    "healthy_client",
    "log_tail",
    "main",
    "prepare_state_dir",
    "read_record",
    "service_environment",
    "stop_services",
    "write_record",
]
