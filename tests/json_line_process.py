"""A helper process driven over stdin and stdout, one JSON line each way (the race tests' writers and
promoters: tests/storage/race_writer.py, tests/flows/promoter.py).

    proc = JsonLineProcess([sys.executable, "tests/storage/race_writer.py", root, "-", "a"])
    answer = proc.ask(op="open", key="k")      # or proc.send(...) to several, then proc.answer() from each
    proc.close()
"""

from __future__ import annotations

import json
import subprocess


class JsonLineProcess:
    def __init__(self, args: list[str], cwd: str | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
        )

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"{self.args} died: {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, **command) -> dict:
        self.send(**command)
        return self.answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
