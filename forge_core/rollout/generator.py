"""Generator: one vLLM engine that stays up across iterations and turns prompts into `Sample`s (the generation
protocol of protocol.py, in this process).

    with Generator(policy_dir, EngineOptions.from_config(cfg.rollout), policy_version=policy.version) as gen:
        samples = gen.generate(prompts, cfg.rollout.sampling, seed=7)   # group_size samples per prompt, in order
        gen.reload(policy_dir, new_version)              # weights rewritten in policy_dir: reload in place
        gen.reload(new_policy_dir, new_version)          # or load another folder of the same architecture
        greedy = gen.generate(prompts, evaluation_sampling(cfg.eval, cfg.rollout.sampling), seed=7)

vLLM starts worker processes with `spawn`, so a script that builds a Generator needs an
`if __name__ == "__main__":` guard. Starting an engine is slow and reloading weights is cheap, hence `reload`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from forge_core.config.schema import SamplingConfig
from forge_core.faults import engine_kill_progress
from forge_core.rollout.engine import EngineOptions, engine_environment, engine_model_problems, on_cpu
from forge_core.rollout.engine_watch import EngineDeathWatch, engine_core_processes
from forge_core.rollout.sampling import request_seed
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)

# config.json keys that may differ between two exports of the same architecture.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype"})


class Generator:
    """A vLLM engine on a local HF folder; `policy_version` names its weights (the artifact's
    weights_version, or any label for a bare folder). ValueError for a folder this vLLM cannot run."""

    def __init__(
        self, policy_dir: str | Path, engine: EngineOptions | None = None, *, policy_version: str
    ) -> None:
        self.policy_dir = Path(policy_dir)
        self.policy_version = policy_version
        self.engine = engine or EngineOptions()
        _check_policy_folder(self.policy_dir)
        _check_engine_runs_model(self.policy_dir)
        start = time.perf_counter()
        engines_before = {p.pid for p in engine_core_processes()}
        self._llm = _start_llm(self.policy_dir, self.engine)
        # A dead engine core must fail `generate`, not hang it (engine_watch.py).
        self._engine_watch = EngineDeathWatch(
            self._llm, [p.pid for p in engine_core_processes() if p.pid not in engines_before]
        ).start()
        self.startup_s = time.perf_counter() - start
        self.reload_s = 0.0
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        log.info("vLLM engine up in %.1fs from %s", self.startup_s, self.policy_dir)

    # ---- generation -----------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]:
        """`sampling.group_size` samples per prompt, in prompt order then sample index, seeded per prompt
        (`request_seed`) so they do not depend on the rest of the batch. ValueError: see check_prompt_lengths."""
        check_prompt_lengths(prompts, sampling, self.max_model_len)
        requests = [{"prompt_token_ids": list(p.prompt_ids)} for p in prompts]
        params = [sampling.build(request_seed(seed, p.group_id, p.prompt_id)) for p in prompts]
        # The progress callback is FORGE_FAULT's kill_vllm hook; without that fault there is no progress bar.
        outputs = self._llm.generate(
            requests, params, use_tqdm=engine_kill_progress(engine_core_processes) or False
        )
        return [sample for prompt, output in zip(prompts, outputs) for sample in _samples_of(prompt, output)]

    # ---- weights --------------------------------------------------------------------------------------

    def reload(self, policy_dir: str | Path, policy_version: str) -> float:
        """Serve `policy_version` from `policy_dir` from now on; returns the reload's seconds.

        The engine's own folder re-reads its weights; another folder must hold the same architecture and
        tokenizer (else ValueError). The version already served reloads nothing (0.0 s). Cached prompt prefixes
        are dropped: they were computed with the old weights.
        """
        new_dir = Path(policy_dir)
        _check_policy_folder(new_dir)
        if policy_version == self.policy_version:
            self.policy_dir, self.reload_s = new_dir, 0.0
            return self.reload_s
        start = time.perf_counter()
        if new_dir.resolve() == self.policy_dir.resolve():
            self._llm.collective_rpc("reload_weights")
        else:
            _check_same_model(self.policy_dir, new_dir)
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new_dir)})
        self._llm.reset_prefix_cache()
        self.policy_dir, self.policy_version = new_dir, policy_version
        self.reload_s = time.perf_counter() - start
        return self.reload_s

    def weight_transfer(self, method: str, *args) -> None:
        """Run one step of the weight-transfer round trip (forge_core.rollout.weight_transfer) in the workers."""
        self._llm.collective_rpc(method, args=args)

    def weights_received(self, policy_version: str, seconds: float) -> None:
        """Serve `policy_version`, whose weights came over a transfer; drops cached prompt prefixes."""
        self._llm.reset_prefix_cache()
        self.policy_version, self.reload_s = policy_version, seconds

    # ---- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine's processes (idempotent)."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        self._engine_watch.stop()
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del llm

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_prompt_lengths(prompts: Sequence[Prompt], sampling: SamplingConfig, max_model_len: int) -> None:
    """ValueError naming the first prompt that is empty or cannot fit max_new_tokens in the context."""
    for prompt in prompts:
        if not prompt.prompt_ids:
            raise ValueError(f"prompt {prompt.prompt_id}: has no tokens; every prompt needs at least one")
        total = len(prompt.prompt_ids) + sampling.max_new_tokens
        if total > max_model_len:
            raise ValueError(
                f"prompt {prompt.prompt_id}: {len(prompt.prompt_ids)} tokens + max_new_tokens="
                f"{sampling.max_new_tokens} = {total} exceeds the policy's context of {max_model_len}; lower "
                "rollout.sampling.max_new_tokens (eval.max_new_tokens) or data.max_seq_len, or raise "
                "model.max_seq_len"
            )


def _start_llm(policy_dir: Path, engine: EngineOptions):
    import torch
    from vllm import LLM

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound its threads; an
    # in-process worker would do that to this whole process (a trainer living here included), so put it back.
    set_num_threads = torch.set_num_threads
    try:
        with engine_environment(engine.environment()):
            return LLM(**engine.llm_kwargs(policy_dir))
    finally:
        torch.set_num_threads = set_num_threads


def _samples_of(prompt: Prompt, output) -> list[Sample]:
    samples = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        token_ids = tuple(int(t) for t in completion.token_ids)
        samples.append(
            Sample(
                prompt_id=prompt.prompt_id,
                group_id=prompt.group_id,
                sample_index=int(completion.index),
                prompt_ids=tuple(prompt.prompt_ids),
                response_ids=token_ids,
                response_logprobs=_sampled_logprobs(completion, token_ids, prompt),
                response_text=completion.text,
                finish_reason=str(completion.finish_reason),
                ground_truth=prompt.ground_truth,
            )
        )
    return samples


def _sampled_logprobs(completion, token_ids: tuple[int, ...], prompt: Prompt) -> tuple[float, ...]:
    positions = completion.logprobs
    assert positions is not None and len(positions) == len(token_ids), (
        f"vLLM returned {0 if positions is None else len(positions)} logprob positions for "
        f"{len(token_ids)} tokens "
        f"of prompt {prompt.prompt_id}"
    )
    # With logprobs=0 each position holds the sampled token (plus the top-1 when they differ).
    return tuple(float(position[token].logprob) for position, token in zip(positions, token_ids))


def _check_policy_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"policy folder {folder}: no config.json; pass a local HF model folder (a committed policy/ "
            "downloaded with forge_core.rollout.fetch_policy)"
        )


def _check_engine_runs_model(folder: Path) -> None:
    """ValueError (fatal) when this platform's vLLM cannot run the model: vLLM would die at the first request."""
    config = json.loads((folder / "config.json").read_text())
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if heads and hidden else None)
    if head_dim is None:
        return  # not a decoder config forgeflow writes: vLLM's own start-up checks are all there is
    problems = engine_model_problems(int(head_dim), cpu=on_cpu(), where=f"policy folder {folder} config.json")
    if problems:
        raise ValueError("; ".join(problems))


def _model_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}


def model_fingerprint(folder: str | Path) -> str:
    """sha256 of what two policy folders must share for an in-place reload: config.json (minus keys that
    vary between exports of one architecture) and tokenizer.json."""
    folder = Path(folder)
    _check_policy_folder(folder)
    digest = hashlib.sha256(json.dumps(_model_config(folder), sort_keys=True).encode())
    tokenizer = folder / "tokenizer.json"
    digest.update(tokenizer.read_bytes() if tokenizer.is_file() else b"")
    return digest.hexdigest()


def _check_same_model(current: Path, new: Path) -> None:
    old_config, new_config = _model_config(current), _model_config(new)
    if old_config != new_config:
        changed = sorted(
            k for k in old_config.keys() | new_config.keys() if old_config.get(k) != new_config.get(k)
        )
        raise ValueError(
            f"reload({new}): its config.json differs from the running engine's ({current}) in {changed}; "
            "in-place reload only swaps weights, start a new Generator for another architecture"
        )
    old_tok, new_tok = current / "tokenizer.json", new / "tokenizer.json"
    if old_tok.is_file() and new_tok.is_file() and old_tok.read_bytes() != new_tok.read_bytes():
        raise ValueError(
            f"reload({new}): its tokenizer.json differs from the running engine's ({current}); start a new "
            "Generator for another tokenizer"
        )
