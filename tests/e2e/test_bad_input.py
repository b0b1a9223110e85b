"""Every bad input: exit code 2, one line naming where and the fix, and nothing started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, run_ds

MARKER_SCRIPT = str(SCRIPTS / "marker.py")

HOSTFILES = {
    "dup": "worker-0 slots=2\n# a comment\nworker-0 slots=4\n",
    "noslots": "worker-0\n",
    "zeroslots": "localhost slots=0\n",
    "badslots": "localhost slots=two\n",
    "extra": "localhost slots=2 max_slots=4\n",
    "empty": "# nothing here\n\n",
    "local2": "localhost slots=2 # two CPU workers\n",
    "remote": "localhost slots=1\nworker-9 slots=1\n",
}

CASES = [
    # (id, args before the script, env file text, expected fragments of the one line)
    ("missing-hostfile", ["--hostfile", "{tmp}/nope"], None,
     ["{tmp}/nope: hostfile not found", "HINT:"]),
    ("duplicate-host", ["--hostfile", "{tmp}/dup"], None,
     ["{tmp}/dup:3: host 'worker-0' is listed twice (first on line 1)"]),
    ("missing-slots", ["--hostfile", "{tmp}/noslots"], None,
     ["{tmp}/noslots:1: missing 'slots=N'", "worker-1 slots=4"]),
    ("zero-slots", ["--hostfile", "{tmp}/zeroslots"], None,
     ["{tmp}/zeroslots:1: slots must be a positive integer, got '0'"]),
    ("bad-slots", ["--hostfile", "{tmp}/badslots"], None, ["{tmp}/badslots:1:", "'two'"]),
    ("extra-token", ["--hostfile", "{tmp}/extra"], None,
     ["{tmp}/extra:1: unexpected 'max_slots=4'"]),
    ("empty-hostfile", ["--hostfile", "{tmp}/empty"], None, ["names no hosts"]),
    ("unknown-host", ["--hostfile", "{tmp}/local2", "--include", "worker-7"], None,
     ["--include: unknown host 'worker-7'"]),
    ("unknown-slot", ["--hostfile", "{tmp}/local2", "--include", "localhost:5"], None,
     ["--include: host 'localhost' has no slot 5 (its slots: 0,1)"]),
    ("bad-selector", ["--include", "localhost:x"], None, ["--include: slot 'x'"]),
    ("include-and-exclude", ["--include", "localhost", "--exclude", "localhost:0"], None,
     ["--include and --exclude cannot be used together"]),
    ("selector-with-count", ["--include", "localhost:0", "--num_gpus", "1"], None,
     ["--include cannot be combined with --num_nodes/--num_gpus"]),
    ("too-many-nodes", ["--hostfile", "{tmp}/local2", "--num_nodes", "2"], None,
     ["--num_nodes: asked for 2 nodes but {tmp}/local2 has 1"]),
    ("too-many-slots", ["--hostfile", "{tmp}/local2", "--num_gpus", "3"], None,
     ["--num_gpus: asked for 3 slots per node but localhost has 2"]),
    ("exclude-all", ["--hostfile", "{tmp}/local2", "--exclude", "localhost"], None,
     ["--exclude: the exclusion leaves no slot"]),
    ("unresolvable-host", ["--hostfile", "{tmp}/remote"], None,
     ["worker-9: cannot reach 1 of 1 host(s): cannot resolve 'worker-9'"]),
    ("remote-with-local-launcher", ["--hostfile", "{tmp}/remote", "--launcher", "local"], None,
     ["host 'worker-9' is not this machine, and --launcher local"]),
    ("env-file-line", [], "GOOD=1\nexport\nBAD LINE\n", ["{tmp}/.deepspeed_env:2: expected"]),
    ("env-file-key", [], "GOOD=1\n1BAD=x\n", ["{tmp}/.deepspeed_env:2: expected KEY=VALUE"]),
    ("zero-gpus", ["--num_gpus", "0"], None, ["--num_gpus", "0"]),
    ("unknown-flag", ["--force_multi"], None, ["No such option '--force_multi'"]),
    ("bad-port", ["--master_port", "70000"], None, ["--master_port"]),
    ("launcher-args-without-pdsh", ["--launcher_args", "-u 30"], None,
     ["--launcher_args is only used by --launcher pdsh"]),
    ("module-and-no-python", ["--module", "--no_python"], None,
     ["--module and --no_python exclude each other"]),
    ("log-dir-is-a-file", ["--log_dir", "{tmp}/local2"], None,
     ["--log_dir {tmp}/local2: exists and is not a directory"]),
]


@pytest.mark.parametrize(("args", "env_text", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(tmp_path, args, env_text, expected):
    for name, text in HOSTFILES.items():
        (tmp_path / name).write_text(text)
    if env_text is not None:
        (tmp_path / ".deepspeed_env").write_text(env_text)
    marker = tmp_path / "started"
    argv = [a.format(tmp=tmp_path) for a in args]
    env = {**os.environ, "HOME": str(tmp_path / "nohome")}
    result = run_ds(*argv, MARKER_SCRIPT, str(marker), cwd=tmp_path, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ds-run: error: ")
    assert "Traceback" not in result.stderr
    for fragment in expected:
        assert fragment.format(tmp=tmp_path) in lines[0]
    assert "HINT:" in lines[0]
    assert result.stdout == ""
    assert not marker.exists()


def test_missing_script(tmp_path):
    result = run_ds("--num_gpus", "2", str(tmp_path / "train.py"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"ds-run: error: {tmp_path}/train.py: training script not found. " \
                            "HINT: check the path, or pass --module to run a module\n"


def test_missing_program_with_no_python(tmp_path):
    result = run_ds("--no_python", "surely-not-a-program-xyz", cwd=tmp_path)
    assert result.returncode == 2
    assert "surely-not-a-program-xyz: program not found" in result.stderr


def test_dry_run_prints_plan_masks_secrets_and_starts_nothing(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("HF_TOKEN=hf_supersecret\nNCCL_DEBUG=INFO\n")
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    marker = tmp_path / "started"
    env = {**os.environ, "HOME": str(tmp_path / "nohome")}
    result = run_ds("--hostfile", "hosts", "--include", "localhost:1,3", "--dry_run",
                    MARKER_SCRIPT, str(marker), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "2 worker(s) on 1 node(s)" in out
    assert "HF_TOKEN=****" in out and "hf_supersecret" not in out
    assert "NCCL_DEBUG=INFO" in out
    assert "CUDA_VISIBLE_DEVICES=1,3" in out
    assert "--local_rank=1" in out
    assert not marker.exists()
    assert not Path(tmp_path / "nohome").exists()
