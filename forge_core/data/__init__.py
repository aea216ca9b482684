"""Data preparation: sources, layouts, tokenizers, the demo task and the prepare stage.

    from forge_core.data import prepare_data                 # the stage, in-process
    from forge_core.data.demo import check_answer, extract_answer   # the demo task's verifier (stdlib only)

Names are imported lazily so `forge_core.data.demo` stays dependency-free for reward functions: importing it
does not pull in pyarrow, tokenizers or the storage layer.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "prepare_data": "forge_core.data.pipeline",
    "stage_config": "forge_core.data.pipeline",
    "HFTokenizer": "forge_core.data.tokenizer",
    "load_tokenizer": "forge_core.data.tokenizer",
    "train_demo_tokenizer": "forge_core.data.tokenizer",
    "train_text_tokenizer": "forge_core.data.tokenizer",
    "TokenizerError": "forge_core.data.tokenizer",
    "DataSourceError": "forge_core.data.sources",
    "read_source": "forge_core.data.sources",
    "RejectReason": "forge_core.data.rejects",
    "RejectThresholdExceeded": "forge_core.data.rejects",
    "SFT_SCHEMA": "forge_core.data.schemas",
    "PROMPTS_SCHEMA": "forge_core.data.schemas",
    "REJECTS_SCHEMA": "forge_core.data.schemas",
    "TABLES": "forge_core.data.schemas",
    "check_answer": "forge_core.data.demo",
    "extract_answer": "forge_core.data.demo",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'forge_core.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
