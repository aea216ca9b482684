"""Data sources generated in the prepare stage rather than read: the tool-use demo task and reasoning-gym tasks.

    data.source: demo_tools                  # 2-digit multiplication with a calculator tool (data.demo sizes)
    data.source: reasoning_gym:chain_sum     # any reasoning-gym task; data.reasoning_gym: sizes and generator kwargs

Both are deterministic in the run's seed and settings. In demo_tools, `data.demo.tool_fraction` of the SFT
examples are tool-use traces (a tiny model cannot learn multiplication, but can learn to call the calculator):

    <calculator>37*48</calculator></s>   <result>1776</result>   <answer>1776</answer></s>
    (model turn, ends with EOS)          (observation: no loss)  (model turn)

A reasoning-gym split drops rows whose question is in eval; its ground truth is the entry as JSON.
"""


from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Iterator
from dataclasses import dataclass

from forge_core.config import RunConfig
from forge_core.data import demo
from forge_core.data.layouts import ExampleBatch
from forge_core.data.traces import join_trace, trace_segments

TOOLS_DEMO_SOURCE = "demo_tools"
REASONING_GYM_PREFIX = "reasoning_gym:"
REASONING_GYM_DISTRIBUTION = "reasoning-gym"
SPLITS = ("eval", "sft", "rl")

# The tool_use environment's defaults (forge_core.envs.tool_env): the demo's traces are written in them.
CALCULATOR = "calculator"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
# Every character a demo_tools prompt, completion or observation can hold (error observations included).
TOOLS_ALPHABET = (
    "0123456789Q: *=?A+-/()."
    + demo.ANSWER_OPEN + demo.ANSWER_CLOSE + f"<{CALCULATOR}></{CALCULATOR}>" + RESULT_OPEN + RESULT_CLOSE
    + "abcdefghijklmnopqrstuvwxyz_"
)


def is_generated(source: str) -> bool:
    return source == TOOLS_DEMO_SOURCE or source.startswith(REASONING_GYM_PREFIX)


@dataclass(frozen=True)
class MultiplicationExample:
    a: int
    b: int
    num_digits: int
    use_tool: bool  # SFT only: a tool-use trace rather than a direct answer

    @property
    def prompt(self) -> str:
        d = self.num_digits
        return f"Q: {self.a:0{d}d}*{self.b:0{d}d}=? A: "

    @property
    def ground_truth(self) -> str:
        return str(self.a * self.b)

    @property
    def completion(self) -> str:
        answer = f"{demo.ANSWER_OPEN}{self.ground_truth}{demo.ANSWER_CLOSE}"
        if not self.use_tool:
            return answer
        d = self.num_digits
        call = f"<{CALCULATOR}>{self.a:0{d}d}*{self.b:0{d}d}</{CALCULATOR}>"
        return join_trace([call, f"{RESULT_OPEN}{self.ground_truth}{RESULT_CLOSE}", answer])


def tools_demo_splits(cfg: RunConfig) -> dict[str, list[MultiplicationExample]]:
    """Disjoint operand pairs (the addition demo's draw) as multiplication examples; the first
    round(tool_fraction * num_sft) SFT examples are tool-use traces."""
    settings = cfg.data.demo
    pairs = demo.generate_splits(settings.num_digits, settings.num_sft, settings.num_rl, settings.num_eval, cfg.seed)
    traces = round(settings.tool_fraction * settings.num_sft)
    return {
        split: [
            MultiplicationExample(p.a, p.b, p.num_digits, use_tool=split == "sft" and i < traces)
            for i, p in enumerate(pairs[split])
        ]
        for split in SPLITS
    }


def reasoning_gym_task(source: str) -> str:
    task = source.removeprefix(REASONING_GYM_PREFIX)
    if not task:
        raise ValueError(f"data.source={source!r}: name the task, e.g. reasoning_gym:chain_sum")
    return task


def reasoning_gym_version() -> str:
    """The installed package's version (part of a reasoning-gym source's key); ValueError if not installed."""
    try:
        return importlib.metadata.version(REASONING_GYM_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            f"data.source=reasoning_gym:...: needs the {REASONING_GYM_DISTRIBUTION!r} package; run "
            f"`pip install {REASONING_GYM_DISTRIBUTION}` (it is in forgeflow's dev extra)"
        ) from exc


def _split_seed(seed: int, split: str) -> int:
    digest = hashlib.blake2b(f"forgeflow-reasoning-gym:{seed}:{split}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def reasoning_gym_rows(cfg: RunConfig) -> dict[str, list[dict]]:
    """{split: reasoning-gym entries}, each split with its own seed, eval questions kept out of sft and rl."""

    task = reasoning_gym_task(cfg.data.source)
    reasoning_gym_version()
    import reasoning_gym

    settings = cfg.data.reasoning_gym
    sizes = {"eval": settings.num_eval, "sft": settings.num_sft, "rl": settings.num_rl}
    rows: dict[str, list[dict]] = {}
    held_out: set[str] = set()
    for split in SPLITS:
        try:
            dataset = reasoning_gym.create_dataset(
                task, seed=_split_seed(cfg.seed, split), size=sizes[split], **settings.kwargs
            )
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            raise ValueError(
                f"data.source={cfg.data.source!r} with data.reasoning_gym.kwargs={settings.kwargs}: reasoning-gym "
                f"cannot build it ({type(exc).__name__}: {exc}); check the task name (reasoning_gym.factory."
                "DATASETS) and its config fields"
            ) from exc
        entries = [dict(entry) for entry in dataset]
        if split == "eval":
            held_out = {entry["question"] for entry in entries}
        else:
            entries = [entry for entry in entries if entry["question"] not in held_out]
        rows[split] = entries
    return rows


def reasoning_gym_prompt(entry: dict) -> str:
    return f"{entry['question']}\nAnswer: "


def reasoning_gym_ground_truth(entry: dict) -> str:
    """The whole entry (question, answer, metadata) as JSON: what the task's scorer needs."""
    return json.dumps(entry, sort_keys=True, default=_jsonable)


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def generated_texts(cfg: RunConfig) -> Iterator[str]:
    """Texts to train the source's BPE on (the SFT split's prompts, model turns and observations)."""
    if cfg.data.source == TOOLS_DEMO_SOURCE:
        for example in tools_demo_splits(cfg)["sft"]:
            yield example.prompt
            yield from trace_segments(example.completion)
        return
    for entry in reasoning_gym_rows(cfg)["sft"]:
        yield reasoning_gym_prompt(entry)
        yield f"{demo.ANSWER_OPEN}{entry['answer']}{demo.ANSWER_CLOSE}"


def generated_batches(cfg: RunConfig, batch_rows: int) -> Iterator[tuple[str, ExampleBatch]]:
    """(split, examples) batches of at most `batch_rows` rows, in split order eval, sft, rl."""
    if cfg.data.source == TOOLS_DEMO_SOURCE:
        splits = tools_demo_splits(cfg)
        for split in SPLITS:
            for start in range(0, len(splits[split]), batch_rows):
                batch = ExampleBatch(f"{TOOLS_DEMO_SOURCE}/{split}")
                for row, example in enumerate(splits[split][start : start + batch_rows], start=start):
                    metadata = json.dumps({"a": example.a, "b": example.b, "tool_trace": example.use_tool})
                    batch.append(row, example.prompt, example.completion, example.ground_truth, metadata)
                yield split, batch
        return
    task = reasoning_gym_task(cfg.data.source)
    for split, entries in reasoning_gym_rows(cfg).items():
        for start in range(0, len(entries), batch_rows):
            batch = ExampleBatch(f"{REASONING_GYM_PREFIX}{task}/{split}")
            for row, entry in enumerate(entries[start : start + batch_rows], start=start):
                completion = f"{demo.ANSWER_OPEN}{entry['answer']}{demo.ANSWER_CLOSE}"
                metadata = json.dumps({"task": task, "index": row}, sort_keys=True)
                batch.append(row, reasoning_gym_prompt(entry), completion, reasoning_gym_ground_truth(entry), metadata)
            yield split, batch
