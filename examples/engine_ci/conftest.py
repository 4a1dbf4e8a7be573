import pytest
import torch


@pytest.fixture
def cuda():
    """A CUDA device, or a skip that says why: a CUDA graph exists only on a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: CUDA graphs exist only on a GPU (the reload-stability tests run on CPU)")
    with torch.no_grad():
        yield torch.device("cuda")
    torch.cuda.synchronize()
