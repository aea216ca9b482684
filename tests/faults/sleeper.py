"""A stand-in worker for launcher and fault-hook tests: `python -m sleeper [process title]` sleeps until killed.

With a title it renames itself (setproctitle, as vLLM names its engine process `VLLM::EngineCore`)."""

import sys
import time

if __name__ == "__main__":
    if len(sys.argv) > 1:
        import setproctitle

        setproctitle.setproctitle(sys.argv[1])
    print("sleeping", flush=True)
    while True:
        time.sleep(1)
