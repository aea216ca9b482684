"""A stand-in worker for launcher and fault-hook tests: `python -m sleeper [process title]` sleeps until killed.

With a title it renames itself (setproctitle, as vLLM names its engine process `VLLM::EngineCore`). It never
writes output: an orphan that writes to its dead launcher's pipe dies of it, and these tests need orphans."""

import sys
import time

if __name__ == "__main__":
    if len(sys.argv) > 1:
        import setproctitle

        setproctitle.setproctitle(sys.argv[1])
    while True:
        time.sleep(1)
