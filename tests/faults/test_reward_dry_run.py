"""The reward dry run of `forgeflow validate` and every flow start ran user reward functions in the validating
process without a timeout: a reward calling os._exit(7) ended validate with rc 7 and no message, a hanging one
hung it, os.execlp replaced it. It runs in the isolated reward workers now, and each is a named problem."""

from __future__ import annotations

import subprocess
import sys

import pytest

REWARDS = "tests.rollout.rewards_for_tests"
PROBE = (
    "import sys\nfrom forge_core.config import load_config\nfrom forge_core.rewards.dry_run import reward_problems\n"
    "cfg = load_config('configs/tiny_test.yaml', [f'rollout.rewards=[{{name: {sys.argv[1]}}}]',"
    " 'rollout.reward_timeout_s=2'])\n"
    "for problem in reward_problems(cfg):\n    print('PROBLEM', problem)\nprint('DONE')\n"
)


@pytest.mark.fault(
    fault="a reward function that calls os._exit(7), one that never returns, one that calls os.execlp",
    where="the reward dry run (forge_core.rewards.dry_run) of forgeflow validate and every flow start",
    checked="validate goes on and names each reward with what happened and the fix; no reward runs in the validating process",
)
@pytest.mark.parametrize(("reward", "said"), [
    ("exits_always", "crash"), ("hangs_always", "time"), ("execs_a_program", "crash"),
])  # fmt: skip
def test_a_misbehaving_reward_is_a_named_problem_of_the_dry_run(reward, said, fault_row):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, f"{REWARDS}:{reward}"], capture_output=True, text=True, timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    problems = [line for line in done.stdout.splitlines() if line.startswith("PROBLEM")]
    assert "DONE" in done.stdout and len(problems) == 1, done.stdout[-3000:]
    assert reward in problems[0] and said in problems[0].lower() and "rollout.rewards" in problems[0], problems[0]
    fault_row.fact(f"{reward}: {problems[0][8:160]}")
