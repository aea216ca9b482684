"""Every fixed timing of forgeflow in one place: poll intervals, grace periods and timeouts, in seconds.

What a run may need to change is a config field, not a constant here: a stage's deadline and kill grace
(`launch.<stage>.deadline_s`, `kill_grace_s`), how long it waits for its nodes (`launch.pool_wait_s`), how long
storage calls ride out an outage (`storage.retry_horizon_s`) and the output leases (`storage.lease_ttl_s`,
`lease_renew_s`), a reward call's bound (`rollout.reward_timeout_s`) and a weight transfer's
(`rollout.weight_sync.timeout_s`). The constants below are what no run needs to choose: how often a loop looks,
how long a clean shutdown may take before force, margins kept above a configured bound. This module imports
nothing, so every layer may read it.
"""

# ---- polls: how often a loop looks ---------------------------------------------------------------------------

# A launch's supervisor: its process's exit and output, and a snapshot of its process tree this often.
LAUNCH_POLL_S = 0.05
LAUNCH_SNAPSHOT_EVERY_S = 0.5
# Waiting for a process tree to end (forge_core.launch.process_tree).
PROCESS_TREE_POLL_S = 0.05
# A runner's look at its cancel request while its attempt runs.
RUNNER_POLL_S = 0.2
# A vLLM engine actor's look at its engine-core process (which may die on its own).
ENGINE_WATCH_POLL_S = 0.5
# A launch's watchdog checks its owner (the flow process): a launch outlives its owner by about this plus one
# process scan.
OWNER_POLL_S = 1.0
# While an attempt waits for its placement group, the stage's log says what it waits for this often.
PLACEMENT_WAIT_REPORT_S = 30.0
# Between two tries of Hosted.revive: each try already waits for Ray's own refusal (a connection attempt).
ACTOR_REVIVE_PAUSE_S = 1.0

# ---- grace periods: a clean end before force ---------------------------------------------------------------

# After a launch's process exits, how long its output pipes may still deliver lines.
LAUNCH_OUTPUT_DRAIN_S = 5.0
# terminate_all_live's bound: the largest kill grace plus this (output drain, supervisor bookkeeping), then
# SIGKILL and at most LAUNCH_KILL_WAIT_S more.
LAUNCH_SHUTDOWN_MARGIN_S = 5.0
LAUNCH_KILL_WAIT_S = 5.0
# How long ending a gang's agents may take beyond the launches' own kill grace before they are killed outright.
GANG_STOP_MARGIN_S = 15.0
# An engine's time to shut vLLM down before its actor is ended: at a flow's normal end, and when a stage stops
# its own engines.
ENGINE_CLOSE_S = 30.0
# The same when the flow is failing: the engines are ended nearly at once.
ENGINE_STOP_GRACE_ON_FAILURE_S = 3.0
# After stopping the engines, how long a stage's thread in the task's process gets to notice and end.
STAGE_THREAD_STOP_GRACE_S = 30.0
# A trainer-group rank's time to answer a heartbeat question, and to leave its process group at a normal end.
TRAINER_RANK_CALL_S = 10.0
TRAINER_CLOSE_S = 30.0

# ---- timeouts and margins ---------------------------------------------------------------------------------

# How long the trainer group's ranks may take to join their rendezvous once all are placed.
TRAINER_RENDEZVOUS_S = 300.0
# A weight-transfer group's members wait this long for each other (rendezvous and each bucket) unless the
# caller passes rollout.weight_sync.timeout_s.
WEIGHT_TRANSFER_TIMEOUT_S = 300.0
# Collectives' timeout outside a forge_core launch (no deadline to stay above), and the margin kept above a
# stage's deadline inside one (a hung collective must not outlive the deadline that names the hung rank).
DEFAULT_PROCESS_GROUP_TIMEOUT_S = 600.0
PROCESS_GROUP_TIMEOUT_MARGIN_S = 60.0
# The launcher's own deadline on a stage worker is a backstop: the runner that started the worker ends it at
# launch.<stage>.deadline_s; only if that runner could not, the launcher ends it this much after the deadline
# and its kill grace.
LAUNCHER_BACKSTOP_S = 60.0
# A fresh reward worker imports forge_core.rewards and the user's reward modules before its first answer.
REWARD_WORKER_STARTUP_S = 120.0
# A reward worker sends the values of the samples it finished at least this often while samples finish: one
# message per sample cost more than the demo's rewards themselves.
REWARD_ANSWER_FLUSH_S = 0.05
# A reward dry run's bound per sample (rollout.reward_timeout_s when lower): validate must not wait long on a
# hang.
REWARD_DRY_RUN_TIMEOUT_S = 5.0
# The longest wait between two tries of one storage call (the backoff grows up to it).
STORAGE_RETRY_MAX_SLEEP_S = 30.0

# ---- clocks and ages ----------------------------------------------------------------------------------------

# A file modified this recently may still be written to: its content hash is not cached.
FINGERPRINT_RACY_WINDOW_S = 2.0
# psutil's create time is the start in clock ticks since boot plus the boot time, which Linux derives from the
# wall clock anew on every read: it moves by a second when the clock is stepped or slewed across a second (VMs),
# so one process read by two processes can differ by 1 s. Another process reusing the pid within this window
# would need the pid space to wrap in it.
CREATE_TIME_TOLERANCE_S = 1.5
# Leftovers of a process that died mid-download or mid-removal in the policy cache are cleared once this old.
POLICY_CACHE_STALE_LEFTOVER_S = 3600.0

# ---- drills -------------------------------------------------------------------------------------------------

# How often a drill looks for its fault's trigger (a marker, a placement group) and at the cluster's state.
DRILL_POLL_S = 0.2
# A slow_node fault stops and resumes the node's processes in cycles of this length (drill.faults.slowdown of
# each cycle stopped): short enough that no heartbeat or collective notices a single stop.
DRILL_THROTTLE_CYCLE_S = 0.1
# A simulated node (a raylet of this machine) registers with the head within this, even on a loaded machine.
DRILL_NODE_START_S = 120.0
# After a run, how long the drill waits for the Prefect API to hold its task runs in final states.
DRILL_TASK_RUNS_S = 180.0
