"""The config loader: YAML + overrides, all-at-once validation, deterministic serialisation."""

from __future__ import annotations

import json
import pickle

import pytest

from forge_core.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    config_to_json,
    load_config,
    replace,
    section_to_dict,
    select_sections,
    validate_config,
)


def write_yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def problems(exc_info) -> list[str]:
    return exc_info.value.errors


def test_defaults_when_no_path():
    assert load_config(None) == RunConfig()


def test_three_kinds_of_mistakes_reported_together_with_key_value_and_fix(tmp_path):
    path = write_yaml(
        tmp_path,
        """
sft:
  stepz: 10
optimizer_lr: 1
data:
  eval_fraction: 1.5
model:
  max_seq_len: "512"
""",
    )
    with pytest.raises(ConfigError) as exc_info:
        load_config(path)
    errors = problems(exc_info)
    assert len(errors) == 4, errors
    unknown, unknown_top, wrong_type, out_of_range = (
        next(e for e in errors if e.startswith(k)) for k in ("sft.stepz=", "optimizer_lr=", "model.", "data.")
    )
    assert "unknown key" in unknown and "did you mean 'sft.steps'?" in unknown and "=10" in unknown
    assert "unknown key" in unknown_top
    assert wrong_type.startswith("model.max_seq_len='512'") and "expected an int, got str" in wrong_type
    assert "e.g. model.max_seq_len=256" in wrong_type
    assert out_of_range.startswith("data.eval_fraction=1.5: must be in [0, 1)")
    message = str(exc_info.value)
    assert message.startswith(f"4 problems in {path}:") and all(e in message for e in errors)


def test_type_rules_int_float_bool_str_literal_optional_list():
    with pytest.raises(ConfigError) as exc_info:
        load_config(
            None,
            [
                "seed=true",  # a bool is not an int
                "sft.optimizer.warmup_steps=2.5",  # a float is not an int
                "grpo.loss.clip_low=yes",  # YAML 1.1 'yes' stays a string; never converted
                "name=12",  # strings are never made from numbers
                "data.format=jsnol",
                "model.hf_path=[a]",
                "rollout.sampling.stop=stop",
                "training.compile=1",
            ],
        )
    by_key = {e.split("=", 1)[0]: e for e in problems(exc_info)}
    assert set(by_key) == {
        "seed",
        "sft.optimizer.warmup_steps",
        "grpo.loss.clip_low",
        "name",
        "data.format",
        "model.hf_path",
        "rollout.sampling.stop",
        "training.compile",
    }
    assert "got bool" in by_key["seed"]
    assert "got float" in by_key["sft.optimizer.warmup_steps"]
    assert "expected a number, got str" in by_key["grpo.loss.clip_low"]
    assert "expected a string, got int" in by_key["name"]
    assert "did you mean 'jsonl'?" in by_key["data.format"]
    assert "expected a string, got list" in by_key["model.hf_path"]
    assert "expected a list" in by_key["rollout.sampling.stop"]
    assert "expected a bool" in by_key["training.compile"]


def test_int_accepted_for_float_and_stored_as_float():
    cfg = load_config(None, ["sft.optimizer.lr=1", "grpo.loss.clip_high=0"])
    assert cfg.sft.optimizer.lr == 1.0 and isinstance(cfg.sft.optimizer.lr, float)
    assert isinstance(cfg.grpo.loss.clip_high, float)
    # Same config whether the file said 1 or 1.0: the content hash must not change.
    assert config_to_json(cfg) == config_to_json(
        load_config(None, ["sft.optimizer.lr=1.0", "grpo.loss.clip_high=0.0"])
    )


def test_yaml_12_scalars_exponent_floats_and_off_is_a_string(tmp_path):
    path = write_yaml(tmp_path, "sft:\n  optimizer:\n    lr: 3e-4\nlogging:\n  wandb_mode: disabled\n")
    assert load_config(path).sft.optimizer.lr == pytest.approx(3e-4)
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, ["logging.wandb_mode=off"])
    assert "logging.wandb_mode='off'" in problems(exc_info)[0] and "'offline'" in problems(exc_info)[0]


def test_duplicate_key_in_yaml_is_an_error(tmp_path):
    path = write_yaml(tmp_path, "seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError) as exc_info:
        load_config(path)
    assert "'seed' appears twice" in str(exc_info.value)


def test_overrides_must_be_a_list_not_one_string():
    with pytest.raises(TypeError, match="overrides='seed=1': pass a list"):
        load_config(None, "seed=1")


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write_yaml(tmp_path, "- a\n- b\n"))


def test_overrides_nested_values_lists_and_merge(tmp_path):
    path = write_yaml(tmp_path, "sft:\n  steps: 20\n  batch_size: 32\n  micro_batch_size: 16\n")
    cfg = load_config(
        path,
        [
            "sft={steps: 7}",  # a mapping merges: batch_size from the file stays
            "storage.root=s3://bucket/prefix",
            'rollout.sampling.stop=["\\n", "###"]',  # YAML double quotes: \n is a newline
            "model.hf_path=null",
            "sft.optimizer.lr=1e-3",
        ],
    )
    assert (cfg.sft.steps, cfg.sft.batch_size, cfg.sft.micro_batch_size) == (7, 32, 16)
    assert cfg.storage.root == "s3://bucket/prefix"
    assert cfg.rollout.sampling.stop == ["\n", "###"]
    assert cfg.model.hf_path is None
    assert cfg.sft.optimizer.lr == pytest.approx(1e-3)


def test_reward_list_from_yaml_and_json_override_and_index(tmp_path):
    path = write_yaml(
        tmp_path,
        """
rollout:
  rewards:
    - name: exact_answer
      weight: 0.5
    - name: per_digit
      weight: 0.5
      kwargs: {pad: "0"}
""",
    )
    cfg = load_config(path, ["rollout.rewards.1.weight=0.25", "rollout.rewards.1.kwargs.strict=true"])
    assert [(r.name, r.weight, r.kwargs) for r in cfg.rollout.rewards] == [
        ("exact_answer", 0.5, {}),
        ("per_digit", 0.25, {"pad": "0", "strict": True}),
    ]
    replaced = load_config(
        path, ['rollout.rewards=[{"name": "math_verify"}, {"name": "answer_format", "weight": 0.1}]']
    )
    assert [(r.name, r.weight) for r in replaced.rollout.rewards] == [
        ("math_verify", 1.0),
        ("answer_format", 0.1),
    ]


def test_override_errors_reported_with_the_rest():
    with pytest.raises(ConfigError) as exc_info:
        load_config(
            None, ["sft.stesp=3", "no_equals_sign", "rollout.rewards.4.weight=1", "sft.steps=[1,", "seed=x"]
        )
    errors = problems(exc_info)
    assert len(errors) == 5, errors
    assert any(e.startswith("sft.stesp=3: unknown key; did you mean 'sft.steps'?") for e in errors)
    assert any("override 'no_equals_sign': expected dotted.key=value" in e for e in errors)
    assert any(e.startswith("rollout.rewards.4: index out of range") for e in errors)
    assert any("override 'sft.steps=[1,': the value is not valid YAML" in e for e in errors)
    assert any(e.startswith("seed='x': expected an int") for e in errors)


def test_unknown_key_suggests_where_it_nests():
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, ["lr=0.1"])
    assert "did you mean 'sft.optimizer.lr' or 'grpo.optimizer.lr'?" in problems(exc_info)[0]


def test_section_checks_name_the_full_key():
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, ["grpo.optimizer.lr=0", "launch.sft.nnodes=0", "sft.micro_batch_size=0"])
    errors = problems(exc_info)
    for expected in (
        "grpo.optimizer.lr=0.0: must be > 0",  # OptimizerConfig says `optimizer.lr`: placed under grpo
        "launch.sft.nnodes=0, nproc_per_node=2: both must be >= 1",  # ResourceConfig says `nnodes`
        "sft.micro_batch_size=0: must be >= 1",
    ):
        assert any(e.startswith(expected) for e in errors), (expected, errors)


def test_cross_field_checks():
    with pytest.raises(ConfigError) as exc_info:
        load_config(
            None,
            ["data.max_seq_len=512", "rollout.sampling.group_size=1", "rollout.prompts_per_iteration=10"],
        )
    errors = problems(exc_info)
    assert any(e.startswith("data.max_seq_len=512: exceeds model.max_seq_len=256") for e in errors)
    assert any(e.startswith("rollout.sampling.group_size=1: GRPO needs >= 2") for e in errors)
    assert any(
        e.startswith("grpo.mini_batch_size=256: must divide the samples per iteration") for e in errors
    )
    # The same values are fine once GRPO is off and the model is long enough.
    cfg = load_config(
        None,
        [
            "data.max_seq_len=512",
            "model.max_seq_len=512",
            "grpo.iterations=0",
            "rollout.sampling.group_size=1",
            "rollout.prompts_per_iteration=10",
        ],
    )
    assert cfg.data.max_seq_len == 512


def test_checks_skip_messages_about_values_already_rejected():
    # batch_size is the wrong type: the multiple-of rule must not add a second, confusing message about it.
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, ["sft.batch_size='128'", "sft.micro_batch_size=48"])
    assert problems(exc_info) == [
        "sft.batch_size='128': expected an int, got str; use a whole number, e.g. sft.batch_size=128"
    ]


def test_json_is_deterministic_sorted_and_round_trips():
    cfg = load_config("configs/qwen3_1_7b_gsm8k.yaml")
    text = config_to_json(cfg)
    assert text == config_to_json(load_config("configs/qwen3_1_7b_gsm8k.yaml"))
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert config_from_dict(json.loads(text)) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert config_to_json(config_from_dict(json.loads(text))) == text
    assert config_to_json(load_config(None, ["seed=1"])) != config_to_json(load_config(None))


def test_config_from_dict_partial_and_invalid():
    cfg = config_from_dict({"sft": {"steps": 5}})
    assert cfg.sft.steps == 5 and cfg.grpo == RunConfig().grpo
    with pytest.raises(ConfigError) as exc_info:
        config_from_dict({"sft": 5})
    assert problems(exc_info)[0].startswith("sft=5: expected a mapping of SFTConfig fields")


def test_validate_config_catches_code_edits():
    cfg = replace(RunConfig(), seed="7")
    with pytest.raises(ConfigError, match="seed='7': expected an int"):
        validate_config(cfg)


def test_defaults_are_not_shared_between_loads():
    first = load_config(None)
    first.rollout.rewards[0].kwargs["x"] = 1
    first.rollout.sampling.stop.append("!")
    assert load_config(None) == RunConfig()


def test_section_helpers():
    cfg = load_config(None, ["sft.steps=9"])
    assert section_to_dict(cfg, "sft")["steps"] == 9
    assert section_to_dict(cfg, "grpo.loss") == cfg.grpo.loss.model_dump()
    assert section_to_dict(cfg, "seed") == 0
    assert select_sections(cfg, ["seed", "sft"]) == {"seed": 0, "sft": config_to_dict(cfg.sft)}
    with pytest.raises(KeyError, match="has no field 'nope'"):
        section_to_dict(cfg, "sft.nope")


def test_config_error_survives_pickling():
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, ["seed=x"])
    clone = pickle.loads(pickle.dumps(exc_info.value))
    assert clone.errors == exc_info.value.errors and str(clone) == str(exc_info.value)


def test_a_flow_lifetime_trainer_spans_nodes_with_whole_gpus_per_rank():
    on_pool = ["grpo.trainer_lifetime=flow", "launch.grpo.nnodes=2", "launch.grpo.nproc_per_node=2"]
    assert load_config(None, on_pool).launch.grpo.nnodes == 2  # a trainer group across two Ray nodes
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, [*on_pool, "launch.grpo.gpus_per_node=3"])
    assert any(
        e.startswith("launch.grpo.gpus_per_node=3: each of the trainer group's launch.grpo.nproc_per_node=2 ranks")
        for e in problems(exc_info)
    ), problems(exc_info)


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("launch.placement=pool", "every stage runs on the run's Ray cluster now"),
        ("launch.sft.rdzv_endpoint=head:29400", "the pipeline arranges every rendezvous on the Ray cluster"),
        ("rollout.engine_state_dir=/tmp/engines", "the rollout engines are Ray actors"),
    ],
)
def test_a_retired_key_is_named_with_what_replaced_it(override, fix):
    with pytest.raises(ConfigError) as exc_info:
        load_config(None, [override])
    key, value = override.split("=")
    (problem,) = problems(exc_info)
    assert problem.startswith(f"{key}={value!r}: no longer a setting; {fix}") and problem.endswith("delete the key")
