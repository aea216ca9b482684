"""Settings of the temporary local Prefect server a run starts for itself when no PREFECT_API_URL is set
(`forgeflow run`, `make demo`). Prefect reads its settings once, when it is imported: call
`use_local_server_settings()` first.
"""

from __future__ import annotations

import os

LOCAL_SERVER_SETTINGS = {
    # A cold SQLite database can take longer than Prefect's default to start on a small machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Telemetry writes compete with the flow's for the fresh SQLite database ("database is locked") and call
    # out to the network; a temporary server has no use for it.

    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def use_local_server_settings() -> None:
    """LOCAL_SERVER_SETTINGS as defaults: a value already in the environment wins."""
    for name, value in LOCAL_SERVER_SETTINGS.items():
        os.environ.setdefault(name, value)
