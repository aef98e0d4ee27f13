"""pytest set-up of the Python package's tests.

In-process ranks on one GPU need a hardware queue each: CUDA_DEVICE_MAX_CONNECTIONS is set here,
before anything starts CUDA. GPU tests ask for the `gpu` fixture, which skips them (with the
reason shown in the summary: run pytest with -rs) when torch or a GPU is missing.
"""

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402


def _gpu_missing():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    import epx

    if not epx.has_cuda:
        return "epx was built without CUDA"
    return None


@pytest.fixture(scope="session")
def gpu():
    why = _gpu_missing()
    if why:
        pytest.skip(f"GPU test: {why}")
    import torch

    return torch.device("cuda", torch.cuda.current_device())
