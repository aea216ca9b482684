"""Record layouts: how a source row becomes (prompt, completion, ground truth), with bad rows rejected.

- `PromptCompletionLayout`: two text columns, plus an optional ground-truth column (else the completion).
- `GSM8KLayout`: `question` and `answer` = reasoning then `#### <number>`; the number is the ground truth.
- `ChatLayout`: `messages` = [{role, content}, ...] ending with the assistant's turn, rendered with the
  tokenizer's chat template; the prompt ends with the generation prompt, the completion is the rest.

    layout = layout_from_config(cfg.data, tokenizer.chat_template, tokenizer.special_tokens)
    examples, rejects = layout.to_examples(raw_batch)

Each layout names the source `fields` it needs and whether its prompts get the tokenizer's special tokens
(chat templates write BOS themselves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jinja2
import pyarrow as pa

from forge_core.data.answers import GSM8K_SEPARATOR, parse_gsm8k_answer
from forge_core.data.chat import ChatTemplate, ChatTemplateError
from forge_core.data.rejects import Reject, RejectReason, raw_text
from forge_core.data.sources import RawBatch
from forge_core.data.tokenizer import SpecialTokens

_MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
NO_METADATA = "{}"


@dataclass
class ExampleBatch:
    """Valid examples of one source, column-wise; `metadata` is one JSON object (text) per row."""

    source: str
    rows: list[int] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    ground_truths: list[str] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, row: int, prompt: str, completion: str, ground_truth: str, metadata: str) -> None:
        self.rows.append(row)
        self.prompts.append(prompt)
        self.completions.append(completion)
        self.ground_truths.append(ground_truth)
        self.metadata.append(metadata)

    def without(self, indices: list[int]) -> ExampleBatch:
        """This batch less the rows at `indices` (itself when there are none)."""
        if not indices:
            return self
        dropped = set(indices)
        return self.take([i for i in range(len(self)) if i not in dropped])

    def take(self, indices: list[int]) -> ExampleBatch:
        return ExampleBatch(
            self.source,
            [self.rows[i] for i in indices],
            [self.prompts[i] for i in indices],
            [self.completions[i] for i in indices],
            [self.ground_truths[i] for i in indices],
            [self.metadata[i] for i in indices],
        )


def _text_problem(value, name: str) -> tuple[RejectReason, str] | None:
    if value is None:
        return RejectReason.MISSING_FIELD, f"{name} is missing or null"
    if not isinstance(value, str):
        return RejectReason.WRONG_TYPE, f"{name} is {type(value).__name__}, expected text"
    if not value.strip():
        return RejectReason.EMPTY_FIELD, f"{name} is empty"
    return None


def _ground_truth_or_none(value) -> str | None:
    if value.__class__ is str:
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _ground_truth_text(value, name: str) -> tuple[str | None, tuple[RejectReason, str] | None]:
    """Ground truth as text: strings as they are (stripped), numbers (not booleans) via str()."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value), None
    problem = _text_problem(value, name)
    return (None, problem) if problem else (value.strip(), None)


def _reject(batch: RawBatch, i: int, problem: tuple[RejectReason, str]) -> Reject:
    values = {name: column[i] for name, column in batch.columns.items()}
    return Reject(batch.source, batch.rows[i], problem[0], problem[1], raw_text(values))


@dataclass(frozen=True)
class PromptCompletionLayout:
    prompt_field: str
    completion_field: str
    ground_truth_field: str | None = None
    adds_special_tokens: bool = True

    @property
    def fields(self) -> dict[str, pa.DataType]:
        names = [self.prompt_field, self.completion_field] + ([self.ground_truth_field] if self.ground_truth_field else [])
        return {name: pa.string() for name in names}

    def to_examples(self, batch: RawBatch) -> tuple[ExampleBatch, list[Reject]]:
        prompts = batch.columns[self.prompt_field]
        completions = batch.columns[self.completion_field]
        if self.ground_truth_field:
            truths = [_ground_truth_or_none(v) for v in batch.columns[self.ground_truth_field]]
        else:
            truths = [c.strip() if c.__class__ is str else None for c in completions]
        # Column-wise fast path: one cheap test per row; only failing rows get a detailed diagnosis.
        failing = [
            i
            for i, (p, c, g) in enumerate(zip(prompts, completions, truths))
            if p.__class__ is not str or c.__class__ is not str or not g or not p.strip() or not c.strip()
        ]
        rejects = [_reject(batch, i, self._problem(batch, i)) for i in failing]
        examples = ExampleBatch(batch.source, batch.rows, prompts, completions, truths, [NO_METADATA] * len(prompts))
        return examples.without(failing), rejects

    def _problem(self, batch: RawBatch, i: int) -> tuple[RejectReason, str]:
        problem = _text_problem(batch.columns[self.prompt_field][i], self.prompt_field)
        problem = problem or _text_problem(batch.columns[self.completion_field][i], self.completion_field)
        if problem is None and self.ground_truth_field:
            _, problem = _ground_truth_text(batch.columns[self.ground_truth_field][i], self.ground_truth_field)
        assert problem is not None, "a row failed the fast check without a reason"
        return problem


@dataclass(frozen=True)
class GSM8KLayout:
    question_field: str
    answer_field: str
    adds_special_tokens: bool = True

    @property
    def fields(self) -> dict[str, pa.DataType]:
        return {self.question_field: pa.string(), self.answer_field: pa.string()}

    def to_examples(self, batch: RawBatch) -> tuple[ExampleBatch, list[Reject]]:
        examples, rejects = ExampleBatch(batch.source), []
        questions = batch.columns[self.question_field]
        answers = batch.columns[self.answer_field]
        for i, (question, answer) in enumerate(zip(questions, answers)):
            problem = _text_problem(question, self.question_field) or _text_problem(answer, self.answer_field)
            truth = None if problem else parse_gsm8k_answer(answer)
            if problem is None and truth is None:
                tail = answer[-80:]
                problem = (
                    RejectReason.UNPARSABLE_GROUND_TRUTH,
                    f"{self.answer_field} has no '{GSM8K_SEPARATOR} <number>' at its end: ...{tail!r}",
                )
            if problem is not None:
                rejects.append(_reject(batch, i, problem))
                continue
            examples.append(batch.rows[i], question, answer, truth, NO_METADATA)
        return examples, rejects


def _messages_problem(messages) -> str | None:
    if not isinstance(messages, list) or len(messages) < 2:
        return "expected a list of at least two {role, content} messages"
    for message in messages:
        if not isinstance(message, dict):
            return f"a message is {type(message).__name__}, expected an object with role and content"
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return "every message needs a text role and a text content"
    if messages[-1]["role"] != "assistant":
        return f"the last message has role {messages[-1]['role']!r}; it must be the assistant's answer"
    if not messages[-1]["content"].strip():
        return "the last assistant message is empty"
    return None


@dataclass(frozen=True)
class ChatLayout:
    messages_field: str
    template: ChatTemplate
    ground_truth_field: str | None = None
    # Chat templates write BOS into the text themselves (transformers tokenizes them the same way).
    adds_special_tokens: bool = False

    @property
    def fields(self) -> dict[str, pa.DataType]:
        fields = {self.messages_field: _MESSAGE_TYPE}
        if self.ground_truth_field:
            fields[self.ground_truth_field] = pa.string()
        return fields

    def to_examples(self, batch: RawBatch) -> tuple[ExampleBatch, list[Reject]]:
        examples, rejects = ExampleBatch(batch.source), []
        conversations = batch.columns[self.messages_field]
        truths = batch.columns[self.ground_truth_field] if self.ground_truth_field else [None] * len(conversations)
        for i, (messages, truth) in enumerate(zip(conversations, truths)):
            problem = self._problem(messages)
            if problem is None:
                messages = _as_messages(messages)
                try:
                    prompt, completion = self.template.split_last_turn(messages)
                except (ChatTemplateError, jinja2.TemplateError) as exc:
                    problem = (RejectReason.INVALID_MESSAGES, f"chat template: {exc}")
            if problem is None:
                truth_value = truth if self.ground_truth_field else messages[-1]["content"]
                truth, problem = _ground_truth_text(truth_value, self.ground_truth_field or "assistant message")
            if problem is not None:
                rejects.append(_reject(batch, i, problem))
                continue
            examples.append(batch.rows[i], prompt, completion, truth, NO_METADATA)
        return examples, rejects

    def _problem(self, messages) -> tuple[RejectReason, str] | None:
        if messages is None:
            return RejectReason.MISSING_FIELD, f"{self.messages_field} is missing or null"
        try:
            messages = _as_messages(messages)
        except ValueError as exc:
            return RejectReason.INVALID_MESSAGES, f"{self.messages_field} is text but not JSON: {exc}"
        detail = _messages_problem(messages)
        return (RejectReason.INVALID_MESSAGES, f"{self.messages_field}: {detail}") if detail else None


def _as_messages(value):
    """Messages as Python objects; a CSV cell holds them as JSON text."""
    return json.loads(value) if isinstance(value, str) else value


Layout = PromptCompletionLayout | GSM8KLayout | ChatLayout


def layout_from_config(data_cfg, chat_template: str | None, special: SpecialTokens) -> Layout:
    """The layout named by `data.layout` with its column mapping; ValueError for chat without a template."""

    if data_cfg.layout == "gsm8k":
        return GSM8KLayout(data_cfg.question_field, data_cfg.answer_field)
    if data_cfg.layout == "chat":
        if not chat_template:
            raise ValueError(
                "data.layout=chat needs a chat template: set data.tokenizer.chat_template, or set "
                "data.tokenizer.path to a tokenizer folder whose tokenizer_config.json / chat_template.jinja has one"
            )
        template = ChatTemplate(chat_template, special.bos, special.eos, special.pad)
        return ChatLayout(data_cfg.messages_field, template, data_cfg.ground_truth_field)
    return PromptCompletionLayout(data_cfg.prompt_field, data_cfg.completion_field, data_cfg.ground_truth_field)
