"""``--launcher openmpi|mpich|impi|mvapich``: the mpirun lines against DeepSpeed 0.19.8's.

DeepSpeed's line is what its own ``deepspeed.launcher.runner.main`` builds for the same
hostfile, flags, environment and ``.deepspeed_env`` (run in the side venv, ``Popen``
replaced by a recorder; skipped when DeepSpeed is absent). The only differences allowed are
the documented ones (:mod:`deepshard.launcher.backends.mpi`): deepshard's exported
additions (MASTER_ADDR/MASTER_PORT where DeepSpeed's workers use mpi4py, and the run's
DEEPSHARD_* contract), MPICH's ``launcher_helper.py`` replaced by the script itself, the
per-run MVAPICH host list file, values never wrapped in quotes. Without DeepSpeed, the
recorded lines in :data:`RECORDED` (from DeepSpeed 0.19.8, CPU accelerator) stand in.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from deepshard import contract
from deepshard.comm.distributed import DistEnv, resolve_dist_env
from deepshard.errors import UsageError
from deepshard.launcher.backends import BACKENDS, get_backend
from deepshard.launcher.backends.mpi import RUNNERS, MpiAgent, first_failure
from deepshard.launcher.cli import make_plan
from deepshard.launcher.options import LaunchOptions
from deepshard.launcher.plan import EXPORT_PREFIXES

DS_PYTHON = Path(os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", "/tmp/dsvenv/bin/python"))
DS_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
_RECORD = r"""
import json, sys
from deepspeed.launcher import runner, multinode_runner as mr
out = []
class Recorder:
    def __init__(self, cmd, env=None, **kw):
        out[-1]["cmd"] = cmd
        self.returncode = 0
    def wait(self):
        return 0
runner.subprocess.Popen = Recorder
mr.MVAPICH_TMP_HOSTFILE = sys.argv[2]
for cls in (mr.OpenMPIRunner, mr.MPICHRunner, mr.IMPIRunner, mr.MVAPICHRunner):
    cls.backend_exists = lambda self: True
import os
for hostfile, env_file, argv in json.loads(sys.argv[1]):
    out.append({})
    open("hf", "w").write(hostfile)
    if env_file:
        open(".deepspeed_env", "w").write(env_file)
    elif os.path.exists(".deepspeed_env"):
        os.unlink(".deepspeed_env")
    try:
        runner.main(argv)
    except (ValueError, RuntimeError) as exc:
        out[-1]["error"] = type(exc).__name__
print("DSCMDS " + json.dumps(out))
"""

HOSTFILE = "n1 slots=2\nn2 slots=2\n"
UNEVEN = "n1 slots=2\nn2 slots=1\n"
ENV = {"PYTHONPATH": "/opt/lib", "UCX_TLS": "rc", "MV2_X": "1"}
"""Exported by both (DeepSpeed exports NCCL_* on CUDA only, deepshard always)."""

# (launcher, hostfile text, extra flags, script args, .deepspeed_env text)
CASES = [
    ("openmpi", HOSTFILE, [], ["--lr", "0.1"], ""),
    ("openmpi", HOSTFILE, ["--launcher_args", "--mca btl_tcp_if_include lo --tag-output"],
     [], "FOO=bar\n"),
    ("openmpi", HOSTFILE, ["--module"], ["x"], ""),
    ("openmpi", HOSTFILE, ["--no_python"], [], ""),
    ("mpich", HOSTFILE, [], ["--lr", "0.1"], "FOO=bar\n"),
    ("mpich", HOSTFILE, ["--launcher_args", "-iface eth1"], [], ""),
    ("impi", HOSTFILE, ["--launcher_args", "-l"], ["a"], "FOO=bar\n"),
    ("mvapich", HOSTFILE, [], ["a"], ""),
    ("mvapich", HOSTFILE, ["--launcher_args", "-v"], [], "FOO=bar\n"),
]
# DeepSpeed raises ValueError, deepshard a UsageError naming the flag. (A selection that
# leaves one host sends DeepSpeed down its local path, deepspeed.launcher.launch on this
# machine whatever the host; deepshard refuses it all the same.)
REFUSED = [
    ("openmpi", HOSTFILE, ["--include", "n1:0@n2"], "--include"),
    ("mpich", HOSTFILE, ["--exclude", "n2:1"], "--exclude"),
    ("impi", HOSTFILE, ["--num_nodes", "2"], "--num_nodes"),
    ("mvapich", HOSTFILE, ["--num_gpus", "1"], "--num_gpus"),
    ("mpich", UNEVEN, [], "hostfile"),
    ("impi", UNEVEN, [], "hostfile"),
    ("mvapich", UNEVEN, [], "hostfile"),
]
SCRIPT = "train.py"


@functools.cache
def _has_deepspeed() -> bool:
    # find_spec, not import: importing DeepSpeed takes seconds
    return DS_PYTHON.exists() and subprocess.run(
        [str(DS_PYTHON), "-c", "import importlib.util, sys; "
         "sys.exit(importlib.util.find_spec('deepspeed') is None)"],
        capture_output=True).returncode == 0


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean directory and environment: only :data:`ENV` is exported by either."""
    for key in list(os.environ):
        if key.startswith((*EXPORT_PREFIXES, *DS_PREFIXES, "DS_ENV_FILE", "DEEPSHARD_")):
            monkeypatch.delenv(key)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text("")
    (tmp_path / SCRIPT).chmod(0o755)  # --no_python runs it from PATH
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def ours(launcher: str, flags: list[str], script_args: list[str]) -> list[str]:
    """deepshard's mpirun line, as ``ds-run --dry_run`` prints it."""
    options = _options(launcher, flags, script_args)
    backend = get_backend(launcher).from_options(options)
    plan = make_plan(options, run_id="r1")
    return backend.command(plan.nodes)


def _options(launcher: str, flags: list[str], script_args: list[str]) -> LaunchOptions:
    values: dict[str, object] = {}
    it = iter(flags)
    for flag in it:
        name = flag.lstrip("-")
        values[name] = True if name in ("module", "no_python") else next(it)
    for key in ("num_nodes", "num_gpus"):
        if key in values:
            values[key] = int(str(values[key]))
    return LaunchOptions(user_script=SCRIPT, user_args=tuple(script_args), hostfile="hf",
                         launcher=launcher, master_addr="10.0.0.1", master_port=29511,
                         **values)  # type: ignore[arg-type]


def deepspeeds(workdir: Path, runs: list[tuple[str, str, list[str]]]) -> list[dict]:
    """DeepSpeed's outcome for each (hostfile text, .deepspeed_env text, argv), in one
    process: ``{"cmd": [...]}`` or ``{"error": "ValueError"}``."""
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir / "home"), "DS_ACCELERATOR": "cpu",
           **ENV}
    done = subprocess.run([str(DS_PYTHON), "-c", _RECORD, json.dumps(runs),
                           str(workdir / "ds_mvapich_hosts")], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=120)
    line = next((x for x in done.stdout.splitlines() if x.startswith("DSCMDS ")), None)
    assert line is not None, done.stderr[-2000:]
    return json.loads(line[len("DSCMDS "):])


def ds_argv(launcher: str, flags: list[str], script_args: list[str]) -> list[str]:
    joined, it = [], iter(flags)
    for flag in it:  # --flag=value: argparse takes no value starting with "-" otherwise
        joined.append(flag if flag in ("--module", "--no_python") else f"{flag}={next(it)}")
    return ["-H", "hf", "--launcher", launcher, "--master_addr", "10.0.0.1",
            "--master_port", "29511", "--no_ssh_check", *joined, SCRIPT, *script_args]


@functools.cache
def deepspeed_outcomes() -> tuple[list[dict], list[dict]]:
    """DeepSpeed's outcomes for :data:`CASES` and :data:`REFUSED`, with DeepSpeed's working
    directory shown as ``CWD`` (one process: importing DeepSpeed takes seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp).resolve()
        (workdir / "home").mkdir()
        runs = [(hostfile, env_file, ds_argv(launcher, flags, args))
                for launcher, hostfile, flags, args, env_file in CASES]
        runs += [(hostfile, "", ds_argv(launcher, flags, []))
                 for launcher, hostfile, flags, _ in REFUSED]
        outcomes = deepspeeds(workdir, runs)
    for outcome in outcomes:
        if "cmd" in outcome:
            outcome["cmd"] = [a.replace(str(DS_PYTHON), "PYTHON").replace(str(workdir), "CWD")
                              for a in outcome["cmd"]]
    return outcomes[:len(CASES)], outcomes[len(CASES):]


def normalised(mine: list[str], theirs: list[str], launcher: str) -> tuple[list, list]:
    """Both lines with the documented differences taken out (see the module docstring)."""
    added = {contract.RUN_ID, contract.RESTART_COUNT}
    if launcher in ("openmpi", "mvapich"):
        added |= {"MASTER_ADDR", "MASTER_PORT"}
    out: list[str] = []
    skip = 0
    for i, arg in enumerate(mine):
        if skip:
            skip -= 1
            continue
        if arg in ("-x", "-genv", "-env") and i + 1 < len(mine):
            key = mine[i + 1].split("=", 1)[0]
            if key in added:
                skip = 1 if "=" in mine[i + 1] else 2
                continue
        out.append(arg.replace(sys.executable, "PYTHON"))
    theirs = [a.replace(str(DS_PYTHON), "PYTHON") for a in theirs]
    if launcher == "mpich":  # DeepSpeed's helper: <path>/launcher_helper.py --launcher mpich
        at = next(i for i, a in enumerate(theirs) if a.endswith("launcher_helper.py"))
        end = at + 3 + (theirs[at + 3] in ("--module", "--no_python"))
        theirs = theirs[:at] + theirs[end:]
    if launcher == "mvapich":
        out[out.index("--hostfile") + 1] = theirs[theirs.index("--hostfile") + 1] = "HOSTS"
    return out, [a.replace("CWD", str(Path.cwd())) for a in theirs]


def _write(workdir: Path, hostfile: str, env_file: str) -> None:
    (workdir / "hf").write_text(hostfile)
    path = workdir / ".deepspeed_env"
    if env_file:
        path.write_text(env_file)
    elif path.exists():
        path.unlink()


@pytest.mark.skipif(not _has_deepspeed(), reason=f"no DeepSpeed side venv at {DS_PYTHON}")
def test_lines_equal_deepspeeds(workdir):
    for case, theirs in zip(CASES, deepspeed_outcomes()[0], strict=True):
        launcher, hostfile, flags, args, env_file = case
        _write(workdir, hostfile, env_file)
        got, want = normalised(ours(launcher, flags, args), theirs["cmd"], launcher)
        assert got == want, case


def test_lines_equal_the_recorded_ones(workdir):
    """The same comparison with DeepSpeed's lines as recorded (DeepSpeed not needed)."""
    for case, want in zip(CASES, RECORDED, strict=True):
        launcher, hostfile, flags, args, env_file = case
        _write(workdir, hostfile, env_file)
        got, want = normalised(ours(launcher, flags, args), want, launcher)
        assert got == want, case


def recorded() -> list[list[str]]:
    """DeepSpeed's lines for :data:`CASES`, as :data:`RECORDED` holds them."""
    lines = []
    for outcome in deepspeed_outcomes()[0]:
        line = list(outcome["cmd"])
        if "--hostfile" in line:  # MVAPICH's host list file
            line[line.index("--hostfile") + 1] = "HOSTS"
        lines.append(["HELPER/launcher_helper.py" if a.endswith("/launcher_helper.py") else a
                      for a in line])
    return lines


@pytest.mark.skipif(not _has_deepspeed(), reason=f"no DeepSpeed side venv at {DS_PYTHON}")
def test_recorded_lines_are_deepspeeds():
    assert recorded() == RECORDED


@pytest.mark.parametrize(("launcher", "hostfile", "flags", "where"), REFUSED)
def test_refused_as_deepspeed_refuses(workdir, launcher, hostfile, flags, where):
    _write(workdir, hostfile, "")
    with pytest.raises(UsageError) as info:
        ours(launcher, flags, [])
    line = str(info.value)
    assert "\n" not in line and "HINT: " in line
    assert info.value.where == (where if where.startswith("--") else "hf")
    if _has_deepspeed():
        index = REFUSED.index((launcher, hostfile, flags, where))
        assert deepspeed_outcomes()[1][index] == {"error": "ValueError"}


@pytest.mark.parametrize("flags", [["--hang_timeout", "5"], ["--log_dir", "logs"],
                                   ["--bind_cores_to_rank"], ["--elastic_training"]])
def test_what_needs_the_agents_is_refused(workdir, flags):
    _write(workdir, HOSTFILE, "")
    options = LaunchOptions(user_script=SCRIPT, hostfile="hf", launcher="openmpi",
                            hang_timeout=5.0 if "--hang_timeout" in flags else None,
                            log_dir="logs" if "--log_dir" in flags else None,
                            bind_cores_to_rank="--bind_cores_to_rank" in flags,
                            elastic_training="--elastic_training" in flags)
    with pytest.raises(UsageError) as info:
        get_backend("openmpi").from_options(options)
    assert info.value.where == flags[0] and info.value.hint


def test_values_are_exported_verbatim(workdir):
    """DeepSpeed writes ``-x KEY="a b"`` (quotes meant for a shell that mpirun never runs):
    deepshard exports the value itself."""
    _write(workdir, HOSTFILE, "NASTY=a b $(touch x) \"q\"\n")
    line = ours("openmpi", [], [])
    assert "NASTY=a b $(touch x) \"q\"" in line


def test_a_local_host_among_remote_ones_is_refused(workdir):
    _write(workdir, "localhost slots=1\nn2 slots=1\n", "")
    options = _options("openmpi", [], [])
    plan = make_plan(options, run_id="r1")
    backend = get_backend("openmpi").from_options(options)
    with pytest.raises(UsageError) as info:
        backend.command(tuple(n for n in plan.nodes if not n.local))
    assert "this machine" in info.value.message


def test_registered_with_deepspeeds_names():
    for name in ("openmpi", "mpich", "impi", "mvapich"):
        assert BACKENDS[name].takes_launcher_args
        assert get_backend(name).runner is RUNNERS[name]


# -- how mpirun's end is told ----------------------------------------------------------------
OMPI_EXIT = """--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[309,1],1]
  Exit code:    3
--------------------------------------------------------------------------
"""
OMPI_SIGNAL = ("mpirun noticed that process rank 2 with PID 0 on node dsh2 exited on "
               "signal 9 (Killed).\n")
HYDRA = ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
         "=   PID 28285 RUNNING AT localhost\n=   EXIT CODE: 9\n")


def test_first_failure_from_open_mpis_words():
    assert first_failure(OMPI_EXIT) == (1, 3)
    assert first_failure(OMPI_SIGNAL) == (2, -9)
    assert first_failure(HYDRA) is None


def test_agent_lines_tell_the_end(workdir):
    _write(workdir, HOSTFILE, "")
    options = _options("openmpi", [], [])
    nodes = make_plan(options, run_id="r1").nodes

    class Run:
        def __init__(self, code, output):
            self.nodes, self.stopped, self.tail = nodes, False, [output]
            self.proc = type("P", (), {"returncode": code})()
            self.queues = {n.host: _Queue() for n in nodes}

    def events(node, run):
        return [contract.decode_line(x) for x in MpiAgent(node, run).lines()]

    ok = Run(0, "")
    assert events(nodes[1], ok) == [contract.Exited(rank=2, returncode=0),
                                    contract.Exited(rank=3, returncode=0),
                                    contract.Done(state="succeeded")]
    failed = Run(3, OMPI_EXIT)
    assert contract.Exited(rank=1, returncode=3) in events(nodes[0], failed)
    assert not any(isinstance(e, contract.Exited) for e in events(nodes[1], failed))
    unknown = Run(9, HYDRA)
    first = events(nodes[0], unknown)
    assert isinstance(first[0], contract.AgentError) and "exit code 9" in first[0].message
    assert first[-1] == contract.Done(state="failed", reason="mpirun ended")


class _Queue:
    def get(self, timeout):
        return None


# -- the workers' side: init_distributed under each MPI ---------------------------------------

@pytest.mark.parametrize(("env", "expected"), [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
      "MASTER_ADDR": "h1", "MASTER_PORT": "7000"}, DistEnv(3, 4, 1, 2, "h1", 7000, "mpi")),
    # MPICH (hydra) under DeepSpeed's line: -genv WORLD_SIZE/LOCAL_SIZE, no RANK
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
      "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "7000"},
     DistEnv(2, 4, 0, 2, "h1", 7000, "mpi")),
    ({"PMIX_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2"},
     DistEnv(1, 2, 0, 2, "127.0.0.1", 29500, "mpi")),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2",
      "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
     DistEnv(1, 2, 1, 2, "127.0.0.1", 29500, "mpi")),
    # Intel MPI under DeepSpeed's line: RANK and LOCAL_RANK per rank, the contract wins
    ({"PMI_RANK": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
      "MASTER_ADDR": "h1", "MASTER_PORT": "7000"}, DistEnv(1, 2, 1, 2, "h1", 7000, "contract")),
])
def test_init_distributed_reads_each_mpi(env, expected):
    assert resolve_dist_env(env) == expected


def test_mpi_across_nodes_needs_master_addr():
    with pytest.raises(UsageError) as info:
        resolve_dist_env({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"})
    assert "MASTER_ADDR" in info.value.message and "-genv" in str(info.value)


# DeepSpeed 0.19.8's lines for CASES (CPU accelerator, ENV exported, cwd CWD)
RECORDED: list[list[str]] = [
    ["mpirun", "-n", "4", "-hostfile", "hf", "--mca", "btl", "^openib", "--mca",
     "btl_tcp_if_include", "eth0", "-x", "UCX_TLS=rc", "-x", "PYTHONPATH=CWD:/opt/lib", "-x",
     "MV2_X=1", "PYTHON", "-u", "train.py", "--lr", "0.1"],
    ["mpirun", "-n", "4", "-hostfile", "hf", "--mca", "btl", "^openib", "--mca",
     "btl_tcp_if_include", "lo", "--tag-output", "-x", "UCX_TLS=rc", "-x",
     "PYTHONPATH=CWD:/opt/lib", "-x", "MV2_X=1", "-x", "FOO=bar", "PYTHON", "-u", "train.py"],
    ["mpirun", "-n", "4", "-hostfile", "hf", "--mca", "btl", "^openib", "--mca",
     "btl_tcp_if_include", "eth0", "-x", "UCX_TLS=rc", "-x", "PYTHONPATH=CWD:/opt/lib", "-x",
     "MV2_X=1", "PYTHON", "-u", "-m", "train.py", "x"],
    ["mpirun", "-n", "4", "-hostfile", "hf", "--mca", "btl", "^openib", "--mca",
     "btl_tcp_if_include", "eth0", "-x", "UCX_TLS=rc", "-x", "PYTHONPATH=CWD:/opt/lib", "-x",
     "MV2_X=1", "train.py"],
    ["mpirun", "-n", "4", "-ppn", "2", "-genv", "PYTHONPATH=CWD:/opt/lib", "-genv", "UCX_TLS=rc",
     "-genv", "MV2_X=1", "-genv", "FOO=bar", "-genv", "MASTER_ADDR", "10.0.0.1", "-genv",
     "MASTER_PORT", "29511", "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2", "-hosts",
     "n1,n2", "PYTHON", "-u", "HELPER/launcher_helper.py", "--launcher", "mpich", "train.py",
     "--lr", "0.1"],
    ["mpirun", "-n", "4", "-ppn", "2", "-iface", "eth1", "-genv", "PYTHONPATH=CWD:/opt/lib",
     "-genv", "UCX_TLS=rc", "-genv", "MV2_X=1", "-genv", "MASTER_ADDR", "10.0.0.1", "-genv",
     "MASTER_PORT", "29511", "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2", "-hosts",
     "n1,n2", "PYTHON", "-u", "HELPER/launcher_helper.py", "--launcher", "mpich", "train.py"],
    ["mpirun", "-ppn", "2", "-l", "-genv", "PYTHONPATH", "CWD:/opt/lib", "-genv", "UCX_TLS", "rc",
     "-genv", "MV2_X", "1", "-genv", "FOO", "bar", "-genv", "MASTER_ADDR", "10.0.0.1", "-genv",
     "MASTER_PORT", "29511", "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2", "-genv",
     "I_MPI_PIN", "0", "-hosts", "n1,n2", "-n", "1", "-env", "RANK", "0", "-env", "LOCAL_RANK",
     "0", "PYTHON", "-u", "train.py", "a", ":", "-n", "1", "-env", "RANK", "1", "-env",
     "LOCAL_RANK", "1", "PYTHON", "-u", "train.py", "a", ":", "-n", "1", "-env", "RANK", "2",
     "-env", "LOCAL_RANK", "0", "PYTHON", "-u", "train.py", "a", ":", "-n", "1", "-env", "RANK",
     "3", "-env", "LOCAL_RANK", "1", "PYTHON", "-u", "train.py", "a"],
    ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", "HOSTS", "-env", "MV2_SMP_USE_CMA=0",
     "-env", "MV2_DEBUG_SHOW_BACKTRACE=1", "-env", "MV2_SUPPORT_DL=1", "-env",
     "MV2_ENABLE_AFFINITY=0", "-env", "MV2_INTER_ALLGATHER_TUNING=5", "-env",
     "MV2_CUDA_USE_NAIVE=0", "-env", "PYTHONPATH=CWD:/opt/lib", "-env", "UCX_TLS=rc", "-env",
     "MV2_X=1", "PYTHON", "-u", "train.py", "a"],
    ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", "HOSTS", "-v", "-env", "MV2_SMP_USE_CMA=0",
     "-env", "MV2_DEBUG_SHOW_BACKTRACE=1", "-env", "MV2_SUPPORT_DL=1", "-env",
     "MV2_ENABLE_AFFINITY=0", "-env", "MV2_INTER_ALLGATHER_TUNING=5", "-env",
     "MV2_CUDA_USE_NAIVE=0", "-env", "PYTHONPATH=CWD:/opt/lib", "-env", "UCX_TLS=rc", "-env",
     "MV2_X=1", "-env", "FOO=bar", "PYTHON", "-u", "train.py"],
]
