"""LaunchSpec validation, the command line it becomes, and the child environment."""

import sys

import pytest

from forge_core.launch import LaunchFailed, LaunchResult, LaunchSpec, Outcome
from forge_core.launch.spec import build_command, build_env


def test_standalone_torchrun_command():
    cmd = build_command(LaunchSpec("forge_core.run", ["sft", "--spec", "s"], nproc_per_node=2), "/logs")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--nnodes") + 1] == "1"
    assert cmd[cmd.index("--node-rank") + 1] == "0"
    assert "--standalone" in cmd and "--rdzv-backend" not in cmd
    assert cmd[cmd.index("--log-dir") + 1] == "/logs"
    assert cmd[-5:] == ["-m", "forge_core.run", "sft", "--spec", "s"]


def test_multinode_command_uses_c10d_rendezvous():
    spec = LaunchSpec(
        "m", [], nproc_per_node=4, nnodes=2, node_rank=1, rdzv_endpoint="head:29400", rdzv_id="job7"
    )
    cmd = build_command(spec, "/logs")
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "head:29400"
    assert cmd[cmd.index("--rdzv-id") + 1] == "job7"
    assert cmd[cmd.index("--node-rank") + 1] == "1"


def test_plain_python_command():
    assert build_command(LaunchSpec("m", ["a"], torchrun=False), "/logs") == [sys.executable, "-m", "m", "a"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"nnodes": 2}, "nnodes=2"),
        ({"node_rank": 1}, "node_rank=1"),
        ({"nproc_per_node": 2, "torchrun": False}, "torchrun=False"),
        ({"deadline_s": 0}, "deadline_s=0"),
        ({"rdzv_endpoint": "nohostport"}, "rdzv_endpoint='nohostport'"),
        ({"env": {"FORGE_LAUNCH_ID": "x"}}, "FORGE_LAUNCH_ID"),
        ({"env": {"A": 1}}, "['A']"),
    ],
)
def test_invalid_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match="invalid LaunchSpec") as info:
        LaunchSpec("m", **kwargs)
    assert field in str(info.value)


def test_env_merges_over_os_environ(monkeypatch):
    monkeypatch.setenv("FROM_PARENT", "1")
    monkeypatch.setenv("OVERRIDDEN", "parent")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    env = build_env(LaunchSpec("m", env={"OVERRIDDEN": "spec"}), "id123", "/tmp/e.json")
    assert env["FROM_PARENT"] == "1" and env["OVERRIDDEN"] == "spec"
    assert env["FORGE_LAUNCH_ID"] == "id123" and env["TORCHELASTIC_ERROR_FILE"] == "/tmp/e.json"
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]:"
    assert env["PYTHONUNBUFFERED"] == "1"
    monkeypatch.setenv("PYTHONUNBUFFERED", "0")
    assert build_env(LaunchSpec("m", torchrun=False), "i", "e")["PYTHONUNBUFFERED"] == "0"


def test_raise_for_outcome():
    ok = LaunchResult(Outcome.SUCCESS, 0, "exited with code 0")
    assert ok.raise_for_outcome() is ok
    for outcome, retryable in [(Outcome.RETRYABLE, True), (Outcome.FATAL, False), (Outcome.CANCELLED, False)]:
        result = LaunchResult(outcome, 1, "rank 1: boom", tail=("a", "last line"), launch_id="abc")
        with pytest.raises(LaunchFailed) as info:
            result.raise_for_outcome()
        assert info.value.retryable is retryable
        assert info.value.result is result
        # The message is the cause and where the rest is; the output stays in the result (and the task log).
        assert str(info.value).startswith(f"rank 1: boom [{outcome.value}; launch abc, ")
        assert "last line" not in str(info.value) and info.value.result.tail[-1] == "last line"
