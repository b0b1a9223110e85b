"""``deepshard.runtime.flops_profiler_api``: ``get_model_profile``'s return values and strings as
DeepSpeed 0.19.8 gives them, and DeepSpeed's ``FlopsProfiler`` start/stop API.

MACs and params below are the numbers DeepSpeed 0.19.8 reports for these models (run with
``DS_ACCELERATOR=cpu``); its FLOPs are higher (6272 for the MLP, 77824 for the conv net)
because it also counts the ReLUs and the convolution's bias, which torch's counter does not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepshard.runtime.flops_profiler_api import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 10))


@pytest.mark.parametrize(("make", "shape", "numbers", "strings"), [
    (mlp, (4, 16), (6144, 3072, 808), ("6.14 K", "3.07 KMACs", "808")),
    (conv, (2, 3, 8, 8), (75776, 37888, 5354), ("75.78 K", "37.89 KMACs", "5.35 K")),
])
def test_get_model_profile_returns_flops_macs_params(make, shape, numbers, strings):
    model = make()
    assert get_model_profile(model, input_shape=shape, print_profile=False,
                             as_string=False) == numbers
    assert get_model_profile(model, input_shape=shape, print_profile=False) == strings
    assert not model.training  # profiled in eval mode, as DeepSpeed does


def test_inputs_from_args_and_kwargs_and_the_warm_up_runs():
    class Calls(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls = nn.Linear(4, 2), 0

        def forward(self, x, scale=1.0):
            self.calls += 1
            return self.lin(x) * scale

    model = Calls()
    flops, macs, params = get_model_profile(model, args=[torch.randn(3, 4)],
                                            kwargs={"scale": 2.0}, warm_up=2,
                                            print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * 3 * 4 * 2, 3 * 4 * 2, 10)
    assert model.calls == 3
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model, print_profile=False)


def test_print_profile_goes_to_stdout_or_output_file(capsys, tmp_path):
    get_model_profile(mlp(), input_shape=(4, 16), detailed=True)
    printed = capsys.readouterr().out
    assert "Profile at step 1:" in printed and "3.07 KMACs" in printed
    out = tmp_path / "profile.txt"
    get_model_profile(mlp(), input_shape=(4, 16), output_file=str(out))
    assert "Module tree" in out.read_text() and capsys.readouterr().out == ""


def test_start_stop_counts_every_forward_in_between():
    model = mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(4, 16))
    model(torch.randn(4, 16))
    prof.stop_profile()
    model(torch.randn(4, 16))  # after stop: not counted
    assert prof.get_total_flops() == 2 * 6144
    assert prof.get_total_macs(as_string=True) == "6.14 KMACs"
    assert prof.get_total_params() == 808 and prof.get_total_duration() > 0
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()


def test_ignored_module_types_get_no_row_but_count_in_their_parent():
    model = mlp()
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.randn(4, 16))
    prof.stop_profile()
    rows = {row.name: row for row in prof.result().modules}
    assert rows["0"].calls == 0 and rows["2"].calls == 0
    assert prof.get_total_flops() == 6144


def test_number_strings_are_deepspeeds():
    # what DeepSpeed 0.19.8's helpers return for these values
    assert number_to_string(6272) == "6.27 K"
    assert number_to_string(0) == "0 "
    assert number_to_string(1.5e9) == "1.5 G"
    assert macs_to_string(3072) == "3.07 KMACs"
    assert params_to_string(808) == "808"
    assert params_to_string(5354) == "5.35 K"
    assert params_to_string(1.3e9) == "1.3 B"
    assert duration_to_string(87.5e-6) == "87.5 us"
    assert flops_to_string(71.68e6) == "71.68 MFLOPS"
