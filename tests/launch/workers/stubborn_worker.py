"""A worker that ignores SIGTERM (a stage stuck in its clean-up): `python -m stubborn_worker`.

Writes its pid to $PLAIN_WORKER_PID_FILE, then `<that file>.sigterm` each time a SIGTERM arrives, and sleeps.
"""

import os
import signal
import time


def note_sigterm(signum, frame):
    with open(os.environ["PLAIN_WORKER_PID_FILE"] + ".sigterm", "a") as f:
        f.write("SIGTERM\n")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, note_sigterm)
    with open(os.environ["PLAIN_WORKER_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
