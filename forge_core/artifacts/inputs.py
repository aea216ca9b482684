"""The one check of an input artifact: committed, and of a kind the reading stage accepts.

    kind = committed_kind(store, uri, "policy", ("sft", "grpo"), "a committed sft or grpo artifact")

Only a missing or unreadable manifest becomes a ValueError (fatal, naming the input); a transient storage error
propagates unchanged (retryable).
"""

from __future__ import annotations

from forge_core.storage import ArtifactError, ObjectStore


def committed_kind(store: ObjectStore, uri: str, name: str, kinds: tuple[str, ...], what: str) -> str:
    """The kind of the committed artifact at `uri`, passed as input `name`; ValueError naming `inputs.<name>`
    when it is not committed or its kind is not one of `kinds`. `what` says what the input should be."""
    try:
        kind = store.read_manifest(uri).kind
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(
            f"inputs.{name}={uri}: cannot read the {' or '.join(kinds)} artifact: {exc}; pass the URI of {what}"
        ) from exc
    if kind not in kinds:
        raise ValueError(f"inputs.{name}={uri}: a {kind!r} artifact; expected one of {list(kinds)} ({what})")
    return kind
