"""The FORGE_FAULT hook: parsing, once-only markers, and the in-process `raise_rank` action (kill_rank is
exercised under torchrun by tests/trainers/test_sft_stage.py)."""

from __future__ import annotations

import pytest

from forge_core.faults import Fault, InjectedFault, fault_environment, maybe_inject_fault, parse_faults


def test_parse_several_faults():
    assert parse_faults("kill_rank:1:3, raise_rank:0:5") == [
        Fault("kill_rank", 1, 3),
        Fault("raise_rank", 0, 5),
    ]


def test_hang_engine_names_an_engine_index():
    assert parse_faults("hang_engine:1") == [Fault("hang_engine", rank=1)]
    with pytest.raises(ValueError, match="hang_engine:<index>"):
        parse_faults("hang_engine:x")


def test_kill_vllm_transfer_counts_loaded_buckets():
    assert parse_faults("kill_vllm_transfer:2@rollout") == [Fault("kill_vllm_transfer", samples=2, stage="rollout")]
    with pytest.raises(ValueError, match="kill_vllm_transfer:<buckets>"):
        parse_faults("kill_vllm_transfer:")


def test_kill_saving_names_a_rank_and_the_step_of_its_checkpoint():
    assert parse_faults("kill_saving:1:16@grpo") == [Fault("kill_saving", rank=1, step=16, stage="grpo")]
    with pytest.raises(ValueError, match="'kill_saving'"):
        parse_faults("kill_saving:1")


@pytest.mark.parametrize("spec", ["kill:1:3", "kill_rank:one:3", "kill_rank:1"])
def test_bad_fault_specs_name_the_entry(spec):
    with pytest.raises(ValueError, match="expected <action>:<rank>:<step>"):
        parse_faults(spec)


def test_raise_fires_only_on_its_rank_and_step(monkeypatch):
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:1:2")
    maybe_inject_fault(rank=0, step=2)
    maybe_inject_fault(rank=1, step=1)
    with pytest.raises(InjectedFault, match="rank 1, step 2"):
        maybe_inject_fault(rank=1, step=2)


def test_once_marker_lets_a_retry_run_clean(monkeypatch, tmp_path):
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:0:1")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(tmp_path / "fired"))
    with pytest.raises(InjectedFault):
        maybe_inject_fault(rank=0, step=1)
    assert (tmp_path / "fired").exists()
    maybe_inject_fault(rank=0, step=1)  # the retry: no fault


def test_the_flow_s_settings_replace_a_node_s_stale_ones(monkeypatch, tmp_path):
    """A Ray node started while another run had FORGE_FAULT_ONCE set keeps it in its environment; the settings a
    flow hands its workers must override it, an unset key included."""
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:0:1")
    monkeypatch.delenv("FORGE_FAULT_ONCE", raising=False)
    flow_settings = fault_environment()
    assert flow_settings == {"FORGE_FAULT": "raise_rank:0:1", "FORGE_FAULT_ONCE": ""}

    stale = tmp_path / "fired-by-another-run"
    stale.touch()
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(stale))  # the node's environment
    for name, value in flow_settings.items():
        monkeypatch.setenv(name, value)  # what the worker applies over it
    with pytest.raises(InjectedFault):
        maybe_inject_fault(rank=0, step=1)
