"""tests/moto_server_process.py with moto's PutObject made atomic, for the commit-race test.

moto 5.2.5 checks `If-None-Match: *` and then stores the object with no lock in between
(`moto.s3.responses.S3Response.put_object`), so on moto two concurrent conditional PUTs of one key could both
succeed, where AWS S3 and MinIO let exactly one through. Serialising PUTs here makes the race test's server
behave like S3: a double commit it finds can then only come from forgeflow.

    python tests/storage/atomic_moto_process.py <port>      # same stdin protocol as moto_server_process.py
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def main(port: int) -> None:
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    put_object = S3Response.put_object

    def atomic_put_object(self, *args, **kwargs):
        with lock:
            return put_object(self, *args, **kwargs)

    S3Response.put_object = atomic_put_object
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moto_server_process import main as serve

    serve(port)


if __name__ == "__main__":
    main(int(sys.argv[1]))
