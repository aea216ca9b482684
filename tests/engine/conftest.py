"""Engine tests run torch on one intra-op thread: on the shared 2-core CI box, OpenMP spin-waiting with 2 threads
per process makes tiny CPU steps up to 40x slower when other processes compete for the cores."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
