import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# one thread: the tiny test shapes are dominated by threading overhead on 2 shared cores
torch.set_num_threads(1)
# Triton kernels read TRITON_INTERPRET when they are decorated, i.e. at their first import, which
# may happen in any test module: without a GPU, set it before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Every test starts seeded and on one intra-op thread (a test may raise it for itself)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
