"""A background sampler: `sample()` called every `every_s` seconds on a thread while a `with` block runs."""

from __future__ import annotations

import threading
from typing import Self


class PeriodicSampler:
    """Subclasses implement `sample()`; it runs once at the start and then every `every_s` until the block ends."""

    def __init__(self, every_s: float, name: str = "forge-sampler") -> None:
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)
