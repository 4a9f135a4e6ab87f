"""When kernels are launched as dependent (core/runtime/dependent_launch.py)."""

from __future__ import annotations

import pytest
import torch

from kestrel.core.runtime import dependent_launch as launch


@pytest.fixture(autouse=True)
def fresh_answers():
    launch.dependent_launch.cache_clear()
    yield
    launch.dependent_launch.cache_clear()


def test_cpu_tensors_are_never_launched_as_dependent():
    assert launch.dependent_launch_args(torch.device("cpu")) == {"DEPENDENT": False, "launch_pdl": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="dependent launch is a CUDA feature")
def test_the_switch_turns_it_off_and_hopper_has_it_on(monkeypatch):
    device = torch.device("cuda")
    hopper_or_later = torch.cuda.get_device_capability(device)[0] >= 9
    assert launch.dependent_launch(device) == hopper_or_later
    launch.configure(False)
    try:
        assert launch.dependent_launch(device) is False
    finally:
        launch.configure(True)
