"""One retrain run's promotion decision, in a process of its own (test_promotion.py), driven over stdin.

    python tests/flows/promoter.py <store root>

Commands, one JSON line each, answered with one JSON line:
  {"op": "read", "pointer": p}                            read the pointer (what a retrain run does at its start)
  {"op": "promote", "candidate": uri, "accuracy": a}      flows.promotion.promote_if_better against what was read
Accuracies (the candidate's own too) come from the `accuracy` metric in each artifact's manifest, as the
retrain flow reads them from its eval artifacts.
"""

from __future__ import annotations

import json
import sys

from flows.promotion import promote_if_better
from forge_core.storage import ObjectStore


def main(root: str) -> None:
    store = ObjectStore(root)

    def accuracy_of(uri: str) -> float:
        return float(store.read_manifest(uri).metrics["accuracy"])

    pointer, seen = None, None
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "read":
            pointer = command["pointer"]
            seen = store.pointer_state(pointer)
            answer = {"version": seen.version, "uri": seen.uri}
        else:
            seen_accuracy = accuracy_of(seen.uri) if seen.uri else None
            decision = promote_if_better(
                store, pointer, command["candidate"], command["accuracy"], seen, seen_accuracy, accuracy_of
            )
            answer = {
                "promoted": decision.promoted,
                "incumbent": decision.incumbent_uri,
                "version": decision.pointer.version,
            }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
