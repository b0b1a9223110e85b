"""``CUDA_VISIBLE_DEVICES`` in ds-run's environment: DeepSpeed's implicit ``--include``.

DeepSpeed 0.19.8's runner (``main``), with no hostfile and a non-empty variable, turns it
into ``--include localhost:<ids>`` over the physical GPUs (its tests: CUDA_VISIBLE_DEVICES=0,2
on 4 GPUs runs on slots 0 and 2; on 2 GPUs it fails with "No slot '2'"). deepshard does the
same; with a selector or ``--num_gpus`` it chooses among the listed GPUs, and a selector
naming a hidden GPU is an error (DeepSpeed silently ignores the variable then).
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from deepshard.errors import UsageError
from deepshard.launcher import cli
from deepshard.launcher.placement import select
from deepshard.launcher.resources import probe_local
from deepshard.launcher.selectors import visible_devices_pool


def pool(visible: str, physical: tuple[int, ...] = (0, 1, 2, 3), **selectors):
    local = probe_local(selectors.get("num_gpus"), {"CUDA_VISIBLE_DEVICES": visible})
    return visible_devices_pool(local, visible, physical, **selectors)


def test_alone_it_is_deepspeeds_include():
    res, note = pool("0,2")
    assert select(res).as_dict() == {"localhost": [0, 2]}
    assert note == "CUDA_VISIBLE_DEVICES=0,2: --include localhost:0,2 (as DeepSpeed does)"
    assert res.origin == "this machine (CUDA_VISIBLE_DEVICES=0,2)"


def test_spaces_are_normalised_in_the_note():
    _, note = pool(" 3, 1 ")
    assert "--include localhost:3,1" in note


def test_a_gpu_the_machine_lacks_is_an_error():
    """DeepSpeed: "No slot '2' specified on host 'localhost'" when only 2 GPUs exist."""
    with pytest.raises(UsageError) as info:
        pool("0,2", physical=(0, 1))
    assert info.value.where == "CUDA_VISIBLE_DEVICES=0,2"
    assert "no GPU 2 (its GPUs: 0,1)" in info.value.message
    assert "HINT: " in str(info.value)


def test_ids_are_trusted_when_the_driver_lists_no_gpu():
    res, _ = pool("5,7", physical=())
    assert res.as_dict() == {"localhost": [5, 7]}


def test_a_gpu_listed_twice_is_an_error():
    with pytest.raises(UsageError, match="listed twice"):
        pool("1,1")


@pytest.mark.parametrize(("flag", "key"), [("--include", "include_text"),
                                           ("--exclude", "exclude_text")])
def test_selectors_choose_among_the_listed_gpus(flag, key):
    res, note = pool("1,2,3", **{key: "localhost:2"})
    assert note == ("CUDA_VISIBLE_DEVICES=1,2,3: " + flag + " chooses among GPUs 1,2,3 "
                    "(DeepSpeed would ignore the variable here)")
    picked = select(res, **{key: "localhost:2"}).as_dict()
    assert picked == ({"localhost": [2]} if flag == "--include" else {"localhost": [1, 3]})


@pytest.mark.parametrize(("flag", "key"), [("--include", "include_text"),
                                           ("--exclude", "exclude_text")])
def test_selector_naming_a_hidden_gpu_is_an_error(flag, key):
    with pytest.raises(UsageError) as info:
        pool("2,3", **{key: "localhost:0,2"})
    err = info.value
    assert err.where == flag
    assert "GPU 0 is hidden by CUDA_VISIBLE_DEVICES=2,3" in err.message
    assert "unset CUDA_VISIBLE_DEVICES" in err.hint and "2,3" in err.hint


def test_num_gpus_takes_the_first_listed_gpus():
    res, note = pool("3,1,2", num_gpus=2)
    assert res.as_dict() == {"localhost": [3, 1]}
    assert "--num_gpus chooses among GPUs 3,1,2" in note


def test_unknown_host_names_the_variable():
    res, _ = pool("0,1")
    with pytest.raises(UsageError, match=r"this machine \(CUDA_VISIBLE_DEVICES=0,1\) has "
                                         "localhost"):
        select(res, include_text="worker-0")


# --- through the command line (--dry_run) ----------------------------------------------------


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))
    monkeypatch.setattr(cli, "gpu_ids", lambda environ: (0, 1, 2, 3))  # the driver's GPUs
    (tmp_path / "train.py").write_text("")
    return "train.py"


def dry_run(*args: str, visible: str | None):
    env = {"CUDA_VISIBLE_DEVICES": visible}
    return CliRunner().invoke(cli.ds_run, ["--dry_run", *args], env=env, prog_name="ds-run",
                              terminal_width=200)


def test_dry_run_shows_the_implicit_include(script):
    result = dry_run(script, visible="0,2")
    assert result.exit_code == 0, result.output
    assert "note: CUDA_VISIBLE_DEVICES=0,2: --include localhost:0,2 (as DeepSpeed does)" \
        in result.output
    assert "CUDA_VISIBLE_DEVICES=0,2" in result.output.split("env on localhost")[1]
    assert "2 worker(s) on 1 node(s)" in result.output


def test_dry_run_without_the_variable_has_no_note(script):
    result = dry_run("--num_gpus", "2", script, visible=None)
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output


def test_empty_variable_keeps_the_cpu_special_case(script):
    result = dry_run("--num_gpus", "2", script, visible="")
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output
    assert "CUDA_VISIBLE_DEVICES=''" in result.output


def test_cli_conflict_is_one_line_exit_2(script, capsys):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "2,3")
        code = cli.run_cli(["--include", "localhost:0", "--dry_run", script], [])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("ds-run: error: --include: GPU 0 is hidden by "
                          "CUDA_VISIBLE_DEVICES=2,3")


def test_cli_gpu_the_machine_lacks(script, capsys):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "0,7")
        code = cli.run_cli(["--dry_run", script], [])
    assert code == 2
    assert "CUDA_VISIBLE_DEVICES=0,7: this machine has no GPU 7 (its GPUs: 0,1,2,3)" in \
        capsys.readouterr().err
