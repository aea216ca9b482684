"""Two real processes commit the same key again and again, on file:// and on moto S3, writing the SAME file
names with different bytes: exactly one commit wins each time, the loser is told the winner's attempt and
URI, and the winner's bytes verify afterwards (nothing of it deleted, truncated or overwritten).

Two kinds of trial alternate: "together" (both write, then both are told to commit at once: whoever the OS
schedules first wins, and the checks hold either way) and "late" (the second writer, opened before the
first committed, writes the same names after that commit and then commits: the old code's overwrite case).
"""

from __future__ import annotations

import hashlib
import sys
import uuid
from pathlib import Path

import pytest
from json_line_process import JsonLineProcess
from race_writer import FILES, payload

from forge_core.storage import MANIFEST_NAME, ObjectStore

pytestmark = pytest.mark.integration  # real writer processes (and a moto server)

TRIALS = 40
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class WriterProcess(JsonLineProcess):
    """A race_writer.py process writing as `tag`."""

    def __init__(self, root: str, endpoint: str | None, tag: str) -> None:
        super().__init__([sys.executable, str(HERE / "race_writer.py"), root, endpoint or "-", tag], cwd=REPO)
        self.tag = tag


def _race_store(kind: str, tmp_path: Path, request) -> tuple[ObjectStore, str | None]:
    if kind == "file":
        return ObjectStore(f"file://{tmp_path}/store"), None
    endpoint = request.getfixturevalue("atomic_s3_endpoint")
    bucket = f"forge-race-{uuid.uuid4().hex[:10]}"
    store = ObjectStore(f"s3://{bucket}/root", endpoint_url=endpoint, retries=3, retry_backoff_s=0.05)
    store.fs.call_s3("create_bucket", Bucket=bucket)
    return store, endpoint


def _trial(store: ObjectStore, a: WriterProcess, b: WriterProcess, key: str, together: bool) -> dict:
    attempts = {a.tag: a.ask(op="open", key=key)["attempt"], b.tag: b.ask(op="open", key=key)["attempt"]}
    if together:
        written = {w.tag: w.ask(op="write")["sha256"] for w in (a, b)}
        a.send(op="commit")
        b.send(op="commit")
        results = {a.tag: a.answer(), b.tag: b.answer()}
    else:  # b opened before a's commit, writes the same names after it, then commits
        written = {a.tag: a.ask(op="write")["sha256"]}
        results = {a.tag: a.ask(op="commit")}
        written[b.tag] = b.ask(op="write")["sha256"]
        results[b.tag] = b.ask(op="commit")
    return {"attempts": attempts, "written": written, "results": results}


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_two_processes_committing_one_key_exactly_one_wins_and_its_bytes_stay_whole(kind, tmp_path, request):
    store, endpoint = _race_store(kind, tmp_path, request)
    a, b = WriterProcess(store.root, endpoint, "a"), WriterProcess(store.root, endpoint, "bb")
    wins = {"a": 0, "bb": 0}
    try:
        for trial in range(TRIALS):
            key = f"k{trial}"
            uri = store.artifact_uri("race", key)
            outcome = _trial(store, a, b, key, together=trial % 2 == 0)
            winners = [tag for tag, r in outcome["results"].items() if r["won"]]
            assert len(winners) == 1, (trial, outcome)
            (winner,) = winners
            (loser,) = set(outcome["results"]) - {winner}
            wins[winner] += 1
            winner_attempt = outcome["attempts"][winner]
            lost = outcome["results"][loser]
            assert (lost["winner"], lost["uri"]) == (winner_attempt, uri), (trial, outcome)
            assert lost["aborted"] == len(outcome["written"][loser])  # its own files, removed by itself

            reader = store.reader(uri)
            assert reader.manifest.attempt == winner_attempt and reader.manifest.config == {"tag": winner}
            assert reader.verify() == sorted(FILES)
            for rel in FILES:
                data = reader.read_bytes(rel)
                assert data == payload(winner, key, rel), (trial, rel)
                assert hashlib.sha256(data).hexdigest() == outcome["written"][winner][rel]
            # The store holds the manifest and the winner's files, nothing of the loser.
            assert sorted(store.list_files(uri)) == sorted(
                [store.join(uri, MANIFEST_NAME), *(reader.file_uri(rel) for rel in FILES)]
            ), trial
    finally:
        a.close()
        b.close()
    # Not a check of the code (either may win any trial): says both sides won races, as a race test should.
    print(f"{kind}: {TRIALS} trials, wins {wins}")
