"""A moto S3 server in a child process, driven over stdin: `python tests/moto_server_process.py <port>`.

Why a child process: moto's server is a Flask app, and importing Flask puts werkzeug `LocalProxy` globals
(`flask.request`, ...) into `sys.modules`; vLLM's in-process engine scans every module's globals when it starts
and trips over them ("Working outside of application context"). Keeping moto out of the test process also
makes the endpoint a real remote server, as in production.

Commands, one per line: `stop` closes the listening socket (clients get "connection refused" like from a dead
server) while moto's data stays in this process; `start` serves again on the same port. Each answers `up` or
`down`; end of stdin ends the process.
"""

from __future__ import annotations

import sys


def main(port: int) -> None:
    from moto.server import ThreadedMotoServer

    server = None

    def start() -> None:
        nonlocal server
        if server is None:
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
        print("up", flush=True)

    def stop() -> None:
        nonlocal server
        if server is not None:
            server.stop()
            # stop() only ends serve_forever(); an open listening socket would queue new connections (clients
            # hang until their read timeout) instead of refusing them.
            server._server.server_close()
            server = None
        print("down", flush=True)

    start()
    for line in sys.stdin:
        {"start": start, "stop": stop}[line.strip()]()
    stop()


if __name__ == "__main__":
    main(int(sys.argv[1]))
