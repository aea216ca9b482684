"""One cluster for the whole module: a Prefect server on loopback, pools `cpu-small` (1 worker), `gpu-a`
(2 workers) and the pipeline pool `local-cpu` (1 worker), each worker as on a node of its own (tests/cluster/
cluster.py), moto S3 the only store."""

from __future__ import annotations

import pytest

from tests.cluster.cluster import Cluster


@pytest.fixture(scope="module")
def cluster(s3_endpoint, tmp_path_factory):
    started = Cluster(tmp_path_factory.mktemp("cluster"), s3_endpoint, {"cpu-small": 1, "gpu-a": 2, "local-cpu": 1})
    try:
        started.start()
        yield started
    finally:
        survivors = started.stop()
    # Whatever the tests did, nothing a worker started may outlive the cluster's orderly stop.
    assert not survivors, f"processes outlived the cluster: {survivors}"
