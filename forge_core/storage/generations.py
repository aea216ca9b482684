"""GenerationLog: a value on an object store that changes by compare-and-swap, on any store.

The value is a series of small JSON objects `<prefix>/g-<n>.json` (n = 1, 2, ...), each created exclusively
(`ObjectStore.create_exclusive`); the newest is the current value. Whoever creates generation n+1 first
changed the value from generation n; everyone else who read n gets False and must re-read. `latest()` relies
on the store listing strongly consistently (S3, MinIO, local disks do).

    log = GenerationLog(store, store.join(store.root, "_pointers", "promoted-demo"))
    n, record = log.latest()                  # (0, None) before the first write
    if not log.append(n, {"uri": new_uri}):   # someone else wrote generation n+1 first
        ...re-read and decide again
"""

from __future__ import annotations

import json
import re

_GENERATION_FILE = re.compile(r"/g-(\d+)\.json$")
_LATEST_READ_TRIES = 5


class GenerationLog:
    """Compare-and-swap value under `prefix` (see the module docstring)."""

    def __init__(self, store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")

    def generation_uri(self, generation: int) -> str:
        return self.store.join(self.prefix, f"g-{generation:010d}.json")

    def generations(self) -> list[int]:
        """Every generation stored, ascending."""
        found = []
        for uri in self.store.list_files(self.prefix):
            match = _GENERATION_FILE.search(uri)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> tuple[int, dict | None]:
        """(newest generation, its record), or (0, None) when nothing was ever written (or it was purged)."""
        for _ in range(_LATEST_READ_TRIES):
            generations = self.generations()
            if not generations:
                return 0, None
            try:
                data = self.store.get_bytes(self.generation_uri(generations[-1]))
            except FileNotFoundError:
                continue  # purged between the listing and the read: list again
            return generations[-1], self._parse(generations[-1], data)
        return 0, None

    def append(self, after: int, record: dict) -> bool:
        """Create generation `after + 1` holding `record`; False when it exists already (someone else won)."""
        data = json.dumps({**record, "generation": after + 1}, sort_keys=True).encode("utf-8")
        return self.store.create_exclusive(self.generation_uri(after + 1), data)

    def purge(self) -> None:
        """Delete every generation (the value is gone: `latest()` is (0, None) again)."""
        self.store.delete_prefix(self.prefix)

    def _parse(self, generation: int, data: bytes) -> dict:
        try:
            record = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"{self.generation_uri(generation)} is not a JSON record: {exc}") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{self.generation_uri(generation)} is not a JSON object")  # noqa: TRY004
        return record
