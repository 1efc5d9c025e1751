"""Shared test helpers. Registers nothing global (markers live in pyproject.toml).

GPU tests are marked ``@pytest.mark.gpu`` and take the ``requires_gpu`` fixture, which skips
them unless torch sees an sm_90 (Hopper) GPU.
"""
import pytest
import torch


def has_hopper_gpu() -> bool:
    """True when torch can use CUDA and device 0 is compute capability 9.0 (sm_90)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


@pytest.fixture
def requires_gpu():
    """Skip the test unless an sm_90 GPU is available; returns the CUDA device."""
    if not has_hopper_gpu():
        pytest.skip("needs an NVIDIA Hopper (sm_90) GPU")
    return torch.device("cuda", 0)
