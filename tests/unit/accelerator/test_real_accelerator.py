"""Which accelerator ``get_accelerator()`` builds: DS_ACCELERATOR, else CUDA, else CPU."""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerator import (
    CPUAccelerator,
    CUDAAccelerator,
    DeepSpeedAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from deepshard.accelerator.real_accelerator import accelerator_name
from deepshard.errors import UsageError


@pytest.mark.parametrize(("environ", "cuda", "name"), [
    ({}, False, "cpu"), ({}, True, "cuda"),
    ({"DS_ACCELERATOR": "cpu"}, True, "cpu"), ({"DS_ACCELERATOR": "cuda"}, False, "cuda"),
    ({"DS_ACCELERATOR": "CUDA"}, False, "cuda"),
])
def test_selection(environ, cuda, name):
    assert accelerator_name(environ, cuda) == name


@pytest.mark.parametrize("value", ["xpu", "", "gpu"])
def test_an_unsupported_value_is_a_one_line_usage_error(value):
    with pytest.raises(UsageError) as err:
        accelerator_name({"DS_ACCELERATOR": value}, cuda_available=True)
    text = str(err.value)
    assert text.startswith(f"environment: DS_ACCELERATOR={value!r} is not an accelerator")
    assert "HINT: set DS_ACCELERATOR to one of cpu, cuda" in text and "\n" not in text


def test_get_accelerator_reads_the_environment_once(monkeypatch):
    set_accelerator(None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    first = get_accelerator()
    assert isinstance(first, CPUAccelerator) and get_accelerator() is first
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert get_accelerator() is first  # chosen once per process, as in DeepSpeed
    set_accelerator(None)
    assert isinstance(get_accelerator(), CUDAAccelerator)
    assert is_current_accelerator_supported()


def test_without_the_variable_it_follows_torch_cuda(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    set_accelerator(None)
    expected = CUDAAccelerator if torch.cuda.is_available() else CPUAccelerator
    assert type(get_accelerator()) is expected


def test_set_accelerator_takes_subclasses_only():
    mine = CPUAccelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine and isinstance(mine, DeepSpeedAccelerator)
    with pytest.raises(UsageError, match=r"str is not an accelerator.*HINT"):
        set_accelerator("cpu")


def test_get_accelerator_with_a_bad_variable_fails_on_use(monkeypatch):
    set_accelerator(None)
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(UsageError, match="DS_ACCELERATOR='tpu'"):
        get_accelerator()
