"""Machine-local state folders must be this user's: the launch registry decides which processes a flow ends,
so a folder someone else owns or can write to is refused with the fix."""

from __future__ import annotations

import os

import pytest

from forge_core.launch import registry


@pytest.fixture
def registry_env(tmp_path, monkeypatch):
    folder = tmp_path / "launches"
    monkeypatch.setenv(registry.REGISTRY_ENV, str(folder))
    return folder


def test_a_new_registry_is_created_private(registry_env):
    registry.record_launch("launch-a", root_pid=os.getpid(), module="m")

    assert registry_env.stat().st_mode & 0o777 == 0o700
    assert registry.launch_owner("launch-a") is not None


def test_a_registry_owned_by_another_user_is_refused(registry_env):
    registry_env.mkdir(mode=0o700)
    os.chown(registry_env, 65534, 65534)  # e.g. pre-created in /tmp by someone else

    with pytest.raises(ValueError, match=r"launch registry \(FORGE_LAUNCH_REGISTRY\)=.*owned by uid 65534"):
        registry.record_launch("launch-a", root_pid=os.getpid(), module="m")
    with pytest.raises(ValueError, match="use a folder of your own"):
        registry.reap_orphaned_launches()
    assert not (registry_env / "launch-a.json").exists()


def test_a_registry_others_can_write_to_is_refused_naming_the_fix(registry_env):
    registry_env.mkdir()
    registry_env.chmod(0o777)
    planted = registry_env / "planted.json"  # whoever can write here picks what the next flow ends
    planted.write_text('{"owner_pid": 1, "owner_create_time": 0}')

    with pytest.raises(ValueError, match=rf"mode 0o777 .*chmod go-w {registry_env}"):
        registry.reap_orphaned_launches()
    with pytest.raises(ValueError, match="chmod go-w"):
        registry.record_launch("launch-a", root_pid=os.getpid(), module="m")

    registry_env.chmod(0o755)  # readable by others is harmless: records hold pids and module names
    assert registry.reap_orphaned_launches() == []
    assert not planted.exists()  # a stale record of our own is dropped as before
