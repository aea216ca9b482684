"""A single-process worker for the launcher's plain-python path: `python -m plain_worker <mode> [n]`.

Modes: `success` prints n numbered lines; `raise-value` raises ValueError under record_errors (imports
torch); `disk-full` raises the OSError a write to a full disk raises (ENOSPC), under record_errors;
`pg-timeout` prints the collectives' timeout forge_core would give this launch; `hang` writes its pid to
$PLAIN_WORKER_PID_FILE and sleeps; `devices` prints its CUDA_VISIBLE_DEVICES and placement record, then waits
until the file $PLAIN_WORKER_GO_FILE exists (so several launches hold their devices at once).
"""

import os
import sys
import time


def run_success(n):
    for i in range(n):
        print(f"plain line {i}")
    print("launch id " + os.environ["FORGE_LAUNCH_ID"])


def run_raise_value():
    from forge_core.launch import record_errors

    @record_errors
    def main():
        raise ValueError("data.path='missing.parquet': file not found; point data.path at a Parquet file")

    main()


def run_disk_full():
    import errno

    from forge_core.launch import record_errors

    @record_errors
    def main():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/store/sft/abc/_attempts/x/model.bin")

    main()


def run_pg_timeout():
    from forge_core.engine.distributed import process_group_timeout_s

    print(f"process group timeout {process_group_timeout_s():g}")


def run_hang():
    with open(os.environ["PLAIN_WORKER_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    print("hanging", flush=True)
    while True:
        time.sleep(1)


def run_devices():
    import json

    print("devices " + os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"), flush=True)
    print("placement " + json.dumps(json.loads(os.environ.get("FORGE_PLACEMENT", "null"))), flush=True)
    while not os.path.exists(os.environ["PLAIN_WORKER_GO_FILE"]):
        time.sleep(0.05)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "success":
        run_success(int(sys.argv[2]))
    elif mode == "raise-value":
        run_raise_value()
    elif mode == "disk-full":
        run_disk_full()
    elif mode == "pg-timeout":
        run_pg_timeout()
    elif mode == "devices":
        run_devices()
    elif mode == "hang":
        run_hang()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
