"""Every test on several ranks runs torch on one thread here (its ranks do too: OMP_NUM_THREADS=1)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
