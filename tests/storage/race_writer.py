"""One writer process of the commit-race test (test_commit_race.py), driven over stdin, one JSON line each way.

    python tests/storage/race_writer.py <store root> <endpoint url or -> <tag>

Commands: {"op": "open", "key": k} opens a writer on `<root>/race/<k>`; {"op": "write"} writes the same file
names every writer writes (a.bin, dir/b.bin) with bytes of its own (their size depends on the tag, so a mix-up
shows as a size mismatch too); {"op": "commit"} commits, and after losing aborts its own attempt. Every answer
says what happened: the attempt, the sha256 of what it wrote, the winner it was told about.
"""

from __future__ import annotations

import hashlib
import json
import sys

from forge_core.storage import ArtifactAlreadyCommitted, ObjectStore

FILES = ("a.bin", "dir/b.bin")


def payload(tag: str, key: str, rel: str) -> bytes:
    seed = hashlib.sha256(f"{tag}/{key}/{rel}".encode()).digest()
    return seed * (40 + 7 * len(tag))


def main(root: str, endpoint: str, tag: str) -> None:
    store = ObjectStore(
        root, endpoint_url=None if endpoint == "-" else endpoint, retries=3, retry_backoff_s=0.05
    )
    writer, key = None, None
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "open":
            key = command["key"]
            writer = store.writer(store.artifact_uri("race", key), kind="data", stage="race")
            answer = {"attempt": writer.attempt}
        elif command["op"] == "write":
            written = {rel: writer.write_bytes(rel, payload(tag, key, rel)).sha256 for rel in FILES}
            answer = {"attempt": writer.attempt, "sha256": written}
        else:
            try:
                writer.commit(config={"tag": tag}, inputs={}, metrics={})
                answer = {"won": True, "attempt": writer.attempt}
            except ArtifactAlreadyCommitted as exc:
                answer = {"won": False, "winner": exc.attempt, "uri": exc.uri, "aborted": writer.abort()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
