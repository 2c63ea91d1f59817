"""tests/audit: run with one intra-op thread. The audit tests compare bits, not speed; on a shared
2-core machine a second thread makes every parallel kernel wait on the neighbours' load."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")  # before module-scoped runs are made
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
