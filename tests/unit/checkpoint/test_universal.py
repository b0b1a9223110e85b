"""deepshard's ``ds_to_universal`` (:mod:`deepshard.runtime.checkpoint.universal`): the
universal form of a DeepSpeed fixture reads back to the fixture's consolidated weights and
optimizer state; DeepSpeed's own universal folder reads the same; bad input is one line
and exit code 2; a damaged universal folder names the parameter."""

from __future__ import annotations

import pytest
import torch

from deepshard.errors import EXIT_USAGE, UsageError
from deepshard.runtime.checkpoint import from_deepspeed, universal
from tests.helpers import ROOT

DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"


@pytest.mark.parametrize("case", ["zero1_bf16", "zero3_fp32"])
def test_converted_reads_back_as_the_checkpoint(case, tmp_path):
    tag = DATA / case / "ckpt" / "global_step2"
    assert universal.main(["--input_folder", str(tag), "--output_folder",
                           str(tmp_path / "global_step2_universal")]) == 0
    assert (tmp_path / "latest_universal").read_text() == "global_step2_universal"
    back = universal.read(tmp_path / "global_step2_universal")
    source = from_deepspeed.read(tag)
    assert set(back.by_name.values) == set(source.by_name.values)
    for name, value in source.by_name.values.items():
        assert torch.equal(back.by_name.values[name].float(), value.float()), name
    for name, state in source.by_name.state.items():
        assert sorted(back.by_name.state[name]) == ["exp_avg", "exp_avg_sq"]
        for key, value in state.items():
            assert torch.equal(back.by_name.state[name][key], value), (name, key)
        assert float(back.by_name.scalars[name]["step"]) == 2.0
    assert back.shared["counters"]["global_steps"] == 2
    assert back.shared["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.005)


def test_deepspeeds_universal_folder_reads_the_same():
    theirs = universal.read(DATA / "universal_zero2" / "ckpt" / "global_step2_universal")
    source = from_deepspeed.read(DATA / "zero2_fp32" / "ckpt" / "global_step2")
    for name, value in source.by_name.values.items():
        assert torch.equal(theirs.by_name.values[name], value), name
    assert universal.find_tag(DATA / "universal_zero2" / "ckpt", None).name == \
        "global_step2_universal"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert universal.main(["--input_folder", str(tmp_path / "nowhere"), "--output_folder",
                           str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "not a checkpoint tag directory" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_parameter_without_fp32_is_named(tmp_path):
    out = tmp_path / "global_step2_universal"
    universal.convert(DATA / "zero2_fp32" / "ckpt" / "global_step2", out)
    (out / "zero" / "fc1.weight" / "fp32.pt").unlink()
    with pytest.raises(UsageError, match=r"parameter folder fc1\.weight has no fp32\.pt"):
        universal.read(out)
