"""Stage planning: content-addressed keys depend on what can change the output, and only on that."""

from __future__ import annotations

import pytest

from forge_core.config import load_config
from forge_core.run.plan import launch_spec_for, plan_stage
from forge_core.storage import ObjectStore


def _cfg(tmp_path, *overrides):
    return load_config("configs/tiny_test.yaml", [f"storage.root=file://{tmp_path}/store", *overrides])


def _committed_input(store: ObjectStore, kind: str, key: str, payload: bytes) -> str:
    uri = store.artifact_uri(kind, key)
    writer = store.writer(uri, kind=kind, stage="test")
    writer.write_bytes("payload.bin", payload)
    writer.commit(config={}, inputs={}, metrics={})
    return uri


def test_key_is_stable_and_ignores_resources_and_logging(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    base = plan_stage(_cfg(tmp_path), store, "prepare")
    again = plan_stage(_cfg(tmp_path), store, "prepare")
    elsewhere = plan_stage(
        _cfg(tmp_path, "launch.prepare.deadline_s=99", "logging.wandb_project=x"), store, "prepare"
    )
    assert base.output_uri == again.output_uri == elsewhere.output_uri
    assert base.output_uri.startswith(store.root) and "/data/" in base.output_uri


def test_key_changes_with_stage_config_params_and_inputs(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    data_a = _committed_input(store, "data", "a", b"a")
    data_b = _committed_input(store, "data", "b", b"b")
    cfg = _cfg(tmp_path)
    base = plan_stage(cfg, store, "sft", inputs={"data": data_a})
    assert plan_stage(_cfg(tmp_path, "sft.steps=5"), store, "sft", inputs={"data": data_a}).key != base.key
    assert plan_stage(cfg, store, "sft", inputs={"data": data_b}).key != base.key
    # A section SFT does not read (rollout sampling) leaves its key alone.
    assert (
        plan_stage(_cfg(tmp_path, "rollout.sampling.temperature=0.5"), store, "sft", {"data": data_a}).key
        == base.key
    )
    rollout_0 = plan_stage(cfg, store, "rollout", {"policy": data_a, "data": data_a}, {"iteration": 0})
    rollout_1 = plan_stage(cfg, store, "rollout", {"policy": data_a, "data": data_a}, {"iteration": 1})
    assert rollout_0.key != rollout_1.key


def test_launch_spec_uses_torchrun_for_training_stages_only(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    cfg = _cfg(tmp_path, "storage.endpoint_url=http://127.0.0.1:9")
    sft = launch_spec_for(plan_stage(cfg, store, "sft", {}), cfg)
    prepare = launch_spec_for(plan_stage(cfg, store, "prepare"), cfg)
    assert sft.torchrun and sft.nproc_per_node == cfg.launch.sft.nproc_per_node
    assert not prepare.torchrun and prepare.nproc_per_node == 1
    assert sft.args[:1] == ["sft"] and sft.args[-1].endswith("/_spec.json")
    assert sft.env["FORGE_S3_ENDPOINT_URL"] == "http://127.0.0.1:9"


def test_unknown_stage_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="unknown; valid stages"):
        plan_stage(_cfg(tmp_path), ObjectStore(f"file://{tmp_path}/store"), "train")


def test_prepare_key_follows_source_file_contents(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    source = tmp_path / "train.jsonl"
    overrides = [f"data.source={source}", "data.format=jsonl", "data.tokenizer.vocab_size=300"]
    source.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    first = plan_stage(_cfg(tmp_path, *overrides), store, "prepare")
    source.write_text('{"prompt": "1+1=", "completion": "3"}\n')
    second = plan_stage(_cfg(tmp_path, *overrides), store, "prepare")
    assert first.key != second.key


# ---- complete keys: what a stage reads from outside the store, its rewards, its environment, its world size


def _folder(path, files: dict[str, bytes]):
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


MODEL_FILES = {"config.json": b'{"vocab_size": 64}', "model.safetensors": b"W" * 4096}


def test_sft_key_follows_the_model_folders_contents_not_its_path(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    data = _committed_input(store, "data", "a", b"a")
    model = _folder(tmp_path / "model", MODEL_FILES)
    copy = _folder(tmp_path / "elsewhere" / "model-copy", MODEL_FILES)

    def sft_key(folder) -> str:
        return plan_stage(_cfg(tmp_path, f"model.hf_path={folder}"), store, "sft", {"data": data}).key

    first = sft_key(model)
    assert sft_key(copy) == first  # the same bytes elsewhere are the same starting point
    _folder(model, {".cache/download.lock": b"x", "_SUCCESS": b""})  # metadata, not content
    assert sft_key(model) == first
    _folder(model, {"model.safetensors": b"V" + b"W" * 4095})  # one weight file rewritten, same size
    rewritten = sft_key(model)
    assert rewritten != first
    assert plan_stage(_cfg(tmp_path), store, "sft", {"data": data}).key not in (first, rewritten)
    # GRPO trains the policy it is given: the starting checkpoint reaches it through that input only.
    grpo = [
        plan_stage(_cfg(tmp_path, *extra), store, "grpo", {"policy": data, "rollouts": data}, {"iteration": 0}).key
        for extra in ([], [f"model.hf_path={model}"])
    ]
    assert grpo[0] == grpo[1]


def test_sft_key_of_a_committed_model_artifact_comes_from_its_manifest(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    data = _committed_input(store, "data", "a", b"a")
    model_uri = store.artifact_uri("sft", "model")
    writer = store.writer(model_uri, kind="sft", stage="test")
    for rel, payload in MODEL_FILES.items():
        writer.write_bytes(rel, payload)
    writer.commit(config={}, inputs={}, metrics={})
    local = _folder(tmp_path / "model", MODEL_FILES)

    from_manifest = plan_stage(_cfg(tmp_path, f"model.hf_path={model_uri}"), store, "sft", {"data": data})
    from_files = plan_stage(_cfg(tmp_path, f"model.hf_path={local}"), store, "sft", {"data": data})

    assert from_manifest.key == from_files.key  # the manifest's hashes are the files' hashes
    assert from_manifest.spec.fingerprints == from_files.spec.fingerprints


TOKENIZER_FILES = {
    "tokenizer.json": b'{"model": {"vocab": {"a": 0}}}',
    "tokenizer_config.json": b'{"eos_token": "a"}',
    "model.safetensors": b"W" * 64,  # a tokenizer folder is often the model folder too
}


def test_prepare_key_follows_the_tokenizer_files_it_reads(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    folder = _folder(tmp_path / "tok", TOKENIZER_FILES)

    def prepare_key(path) -> str:
        return plan_stage(_cfg(tmp_path, f"data.tokenizer.path={path}"), store, "prepare").key

    first = prepare_key(folder)
    assert prepare_key(_folder(tmp_path / "moved", TOKENIZER_FILES)) == first
    _folder(folder, {"model.safetensors": b"V" * 64})  # prepare never reads the weights
    assert prepare_key(folder) == first
    _folder(folder, {"tokenizer_config.json": b'{"eos_token": "b"}'})
    assert prepare_key(folder) != first


_REWARD_MODULE = '''
THRESHOLD = {threshold}


def _passes(text):
    return len(text) <= THRESHOLD


def short(completion, ground_truth, **kwargs):
    return float(_passes(completion))
'''


def test_scoring_keys_follow_the_user_reward_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "forge_plan_test_reward.py"
    module.write_text(_REWARD_MODULE.format(threshold=4))
    store = ObjectStore(f"file://{tmp_path}/store")
    policy = _committed_input(store, "sft", "p", b"p")
    data = _committed_input(store, "data", "d", b"d")
    rollouts = _committed_input(store, "rollouts", "r", b"r")
    reward = 'rollout.rewards=[{"name": "forge_plan_test_reward:short"}]'

    def keys() -> dict[str, str]:
        cfg = _cfg(tmp_path, reward)
        return {
            "rollout": plan_stage(cfg, store, "rollout", {"policy": policy, "data": data}, {"iteration": 0}).key,
            "evaluate": plan_stage(cfg, store, "evaluate", {"policy": policy, "data": data}).key,
            "grpo": plan_stage(cfg, store, "grpo", {"policy": policy, "rollouts": rollouts}, {"iteration": 0}).key,
        }

    before = keys()
    assert keys() == before
    module.write_text(_REWARD_MODULE.format(threshold=5))  # only a constant the function uses changes
    after = keys()

    assert after["rollout"] != before["rollout"]
    assert after["evaluate"] != before["evaluate"]
    assert after["grpo"] == before["grpo"]  # GRPO reads the scores from its rollouts input


def test_code_version_moves_with_every_package_that_shapes_results():
    from forge_core.storage.keys import RESULT_PACKAGES, code_version, installed_package_versions

    installed = installed_package_versions()
    assert set(installed) == set(RESULT_PACKAGES)
    assert installed["torch"] != "absent" and installed["pyarrow"] != "absent"
    baseline = code_version()
    assert code_version(installed) == baseline
    bumped = {code_version({**installed, name: installed[name] + ".post1"}) for name in RESULT_PACKAGES}
    assert baseline not in bumped and len(bumped) == len(RESULT_PACKAGES)


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_training_keys_follow_the_world_size_and_nothing_else_of_launch(tmp_path, stage):
    store = ObjectStore(f"file://{tmp_path}/store")
    data = _committed_input(store, "data", "a", b"a")
    inputs, params = ({"data": data}, {}) if stage == "sft" else ({"policy": data, "rollouts": data}, {"iteration": 0})

    def key(*overrides: str) -> str:
        return plan_stage(_cfg(tmp_path, *overrides), store, stage, inputs, params).key

    base = key(f"launch.{stage}.nproc_per_node=2")
    assert key(f"launch.{stage}.nproc_per_node=4") != base
    two_nodes = (f"launch.{stage}.nnodes=2",)
    assert key(f"launch.{stage}.nproc_per_node=1", *two_nodes) == base  # 2 x 1 ranks = 1 x 2 ranks
    operational = (f"launch.{stage}.deadline_s=7", f"launch.{stage}.pool=gpu-b", f"launch.{stage}.retries=9")
    assert key(f"launch.{stage}.nproc_per_node=2", *operational, "logging.wandb_project=elsewhere") == base
    # A stage that is not distributed does not care how many ranks training used.
    rollouts = {
        plan_stage(_cfg(tmp_path, f"launch.{stage}.nproc_per_node={n}"), store, "rollout", {"policy": data},
                   {"iteration": 0}).key
        for n in (1, 4)
    }
    assert len(rollouts) == 1


@pytest.mark.integration
def test_the_worker_refuses_a_source_rewritten_after_planning_and_the_retry_plans_anew(tmp_path):
    from forge_core.launch import Outcome, launch
    from forge_core.run.spec import write_spec

    store = ObjectStore(f"file://{tmp_path}/store")
    source = tmp_path / "train.jsonl"
    rows = "".join(f'{{"prompt": "{i}+1=", "completion": "{i + 1}"}}\n' for i in range(40))
    source.write_text(rows)
    cfg = _cfg(tmp_path, f"data.source={source}", "data.format=jsonl", "data.tokenizer.vocab_size=300")
    stale = plan_stage(cfg, store, "prepare")
    write_spec(store, stale.spec)
    source.write_text(rows.replace('"1+1="', '"one+1="'))  # rewritten between planning and running

    refused = launch(launch_spec_for(stale, cfg), log=lambda line: None)

    assert refused.outcome is Outcome.RETRYABLE, refused.reason
    assert "SourceChanged" in refused.reason and "data.source=" in refused.reason
    assert "changed after it was planned" in refused.reason
    assert not store.is_committed(stale.output_uri)
    fresh = plan_stage(cfg, store, "prepare")  # what the task's retry does
    assert fresh.key != stale.key
    write_spec(store, fresh.spec)
    done = launch(launch_spec_for(fresh, cfg), log=lambda line: None)
    assert done.outcome is Outcome.SUCCESS, done.reason
    assert store.is_committed(fresh.output_uri)
