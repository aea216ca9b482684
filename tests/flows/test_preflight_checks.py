"""`forgeflow validate` and every flow start run one preflight (flows.preflight.check_run): each config here used to
pass validate and then fail at run time, after the prepare stage. Now each is a problem named before any stage
runs, all of them at once, each with its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from flows.preflight import check_run
from forge_core.config import load_config
from forge_core.engine.preflight import PreflightError

GSM8K = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(40)]


def _problems(cfg, **kwargs) -> list[str]:
    try:
        check_run(cfg, **kwargs)
    except PreflightError as error:
        return error.problems
    return []


def _cfg(tmp_path, *overrides):
    return load_config("configs/tiny_test.yaml", [f"storage.root=file://{tmp_path}/store", *overrides])


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A Qwen3 checkpoint of the qwen3 `tiny` sizes with a 256-position context, as transformers saves it."""
    folder = tmp_path_factory.mktemp("qwen3-tiny")
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gsm8k_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K))
    return path


def test_the_demo_and_tiny_configs_pass(tmp_path, prefect_api):
    assert _problems(_cfg(tmp_path)) == []
    assert _problems(load_config(None, [f"storage.root=file://{tmp_path}/store"])) == []


def test_a_gpu_request_on_this_cpu_host_is_named(tmp_path, prefect_api):
    problems = _problems(_cfg(tmp_path, "launch.sft.pool=gpu-a", "launch.sft.gpus_per_node=1"))
    assert any(p.startswith("launch.sft.gpus_per_node=1 asks for GPUs") for p in problems), problems
    # A joined cluster's nodes check themselves (each actor runs preflight on its node): nothing of this host's.
    joined = _problems(_cfg(tmp_path, "launch.sft.gpus_per_node=1", "launch.ray_address=127.0.0.1:6379"))
    assert not any("asks for GPUs" in p for p in joined), joined


def test_a_flavor_that_disagrees_with_the_checkpoint(tmp_path, tiny_checkpoint, prefect_api):
    cfg = _cfg(tmp_path, "model.family=qwen3", "model.flavor=1.7B", f"model.hf_path={tiny_checkpoint}")
    (problem,) = _problems(cfg)
    assert "model.flavor='1.7B' disagrees with the checkpoint's config.json" in problem
    assert "hidden_size: flavor 2048 vs checkpoint 128" in problem and "model.flavor=auto" in problem
    assert _problems(_cfg(tmp_path, "model.family=qwen3", "model.flavor=auto", f"model.hf_path={tiny_checkpoint}")) == []


def test_max_seq_len_beyond_the_checkpoints_context(tmp_path, tiny_checkpoint, prefect_api):
    cfg = _cfg(tmp_path, "model.family=qwen3", "model.flavor=auto", f"model.hf_path={tiny_checkpoint}",
               "model.max_seq_len=512")
    (problem,) = _problems(cfg)
    assert problem.startswith("model.max_seq_len=512: exceeds the checkpoint's context, max_position_embeddings=256")


def test_wandb_online_without_credentials(tmp_path, monkeypatch, prefect_api):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    (problem,) = _problems(_cfg(tmp_path, "logging.wandb_mode=online"))
    assert problem.startswith("logging.wandb_mode='online': no WANDB_API_KEY") and "wandb_mode=offline" in problem


def test_missing_model_folder_tokenizer_and_data_source_together(tmp_path, prefect_api):
    cfg = _cfg(tmp_path, f"model.hf_path={tmp_path}/no-model", "model.flavor=auto",
               f"data.source={tmp_path}/no-data.jsonl", f"data.tokenizer.path={tmp_path}")
    problems = _problems(cfg)
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"model.hf_path='{tmp_path}/no-model': no such folder; give an HF model folder")
    assert problems[1].startswith(f"data.tokenizer.path='{tmp_path}': the folder has no tokenizer.json")
    assert problems[2].startswith(f"data.source='{tmp_path}/no-data.jsonl': no such file or folder")


def test_a_missing_bucket(s3_endpoint, prefect_api, tmp_path):
    cfg = _cfg(tmp_path, "storage.root=s3://no-such-bucket-here/x", f"storage.endpoint_url={s3_endpoint}")
    (problem,) = _problems(cfg)
    assert problem.startswith("storage.root='s3://no-such-bucket-here/x': cannot reach the store") and "bucket" in problem


def test_training_on_cuda_on_a_host_without_a_gpu(tmp_path, prefect_api):
    problems = _problems(_cfg(tmp_path, "training.device=cuda"))
    assert [p.split(":")[0] for p in problems] == ["sft", "grpo"]
    assert all("training.device='cuda' asks for a GPU" in p and "training.device=cpu" in p for p in problems)


def test_a_reward_that_scores_zero_on_every_reference(tmp_path, gsm8k_source, prefect_api):
    """The GPU example's answer_format looks for <answer> tags, which GSM8K answers never have."""
    cfg = _cfg(tmp_path, f"data.source={gsm8k_source}", "data.layout=gsm8k", "data.tokenizer.vocab_size=300",
               "rollout.rewards=[{name: numeric_answer}, {name: answer_format, weight: 0.1}]", "sft.verifier=numeric_answer")
    (problem,) = _problems(cfg)
    assert problem.startswith("rollout.rewards[1].name='answer_format': scored 0 on all 16 reference answers")
    assert "data.layout='gsm8k'" in problem and "numeric_answer" in problem
    # SFT's validation verifier is a reward too: exact_answer (the default) cannot score GSM8K references.
    (verifier,) = _problems(_cfg(tmp_path, f"data.source={gsm8k_source}", "data.layout=gsm8k",
                                 "data.tokenizer.vocab_size=300", "rollout.rewards=[{name: numeric_answer}]"))
    assert verifier.startswith("sft.verifier='exact_answer': scored 0 on all 16 reference answers")


def test_validate_prints_every_problem_and_exits_2(tmp_path, prefect_api):
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", "configs/tiny_test.yaml", f"storage.root=file://{tmp_path}/s",
         f"model.hf_path={tmp_path}/none", "model.flavor=auto", f"data.source={tmp_path}/none.jsonl",
         "data.tokenizer.vocab_size=300"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "2 problems running this config" in result.stderr
    assert "model.hf_path=" in result.stderr and "data.source=" in result.stderr


def test_a_prefect_api_open_to_the_network_is_a_problem_with_the_fix():
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.preflight import open_api_problem, prefect_api_problems

    assert open_api_problem(None, None, None) is None  # the ephemeral API of this process
    assert open_api_problem("http://127.0.0.1:4200/api", None, None) is None
    assert open_api_problem("http://localhost:4200/api", None, None) is None
    assert open_api_problem("http://[::1]:4200/api", None, None) is None
    assert open_api_problem("http://prefect.internal:4200/api", "admin:pw", None) is None
    assert open_api_problem("https://api.prefect.cloud/api/accounts/a/workspaces/w", None, "pnu_key") is None
    problem = open_api_problem("http://10.1.2.3:4200/api", None, None)
    assert "PREFECT_API_URL=http://10.1.2.3:4200/api" in problem and "PREFECT_SERVER_API_AUTH_STRING" in problem
    cfg = load_config("configs/tiny_test.yaml")
    with temporary_settings({PREFECT_API_URL: "http://prefect.internal:4200/api"}):
        assert len(prefect_api_problems(cfg)) == 1
        with temporary_settings({PREFECT_API_AUTH_STRING: "admin:pw"}):
            assert prefect_api_problems(cfg) == []
