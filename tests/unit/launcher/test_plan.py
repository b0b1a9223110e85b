"""deepshard.launcher.plan (the LaunchPlan) and deepshard.launcher.plan_render (--dry_run)."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard import contract
from deepshard.launcher.options import LaunchOptions
from deepshard.launcher.placement import place
from deepshard.launcher.plan import NodePlan, WorkerPlan, build_plan, worker_argv
from deepshard.launcher.plan_render import MASK, is_secret, render_plan, shown_env
from deepshard.launcher.resources import Host, Resources

PY = "/usr/bin/python3"


def make_plan(options=None, slots=None, env_vars=None, restart_count=0, local=None):
    options = options or LaunchOptions(user_script="train.py", user_args=("--lr", "0.1"))
    slots = slots or {"node-a": (1, 3), "node-b": (0, 1, 2)}
    res = Resources(tuple(Host(h, s) for h, s in slots.items()), "hf")
    return build_plan(
        options, place(res), env_vars or {},
        python=PY, cwd="/work/job", master_addr="node-a", master_port=29512,
        run_id="run-42", is_local=local or {h: h == "node-a" for h in slots},
        restart_count=restart_count,
    )


def worker_env(node: NodePlan, worker: WorkerPlan) -> dict[str, str]:
    return {**dict(node.env), **dict(worker.env)}


# --- worker_argv ---------------------------------------------------------------------------


def test_argv_local_rank_before_user_args():
    opts = LaunchOptions(user_script="train.py", user_args=("--deepspeed", "--local_rank=9"))
    assert worker_argv(opts, PY, 2) == (
        PY, "-u", "train.py", "--local_rank=2", "--deepspeed", "--local_rank=9")


def test_argv_no_local_rank():
    opts = LaunchOptions(user_script="train.py", user_args=("a",), no_local_rank=True)
    assert worker_argv(opts, PY, 2) == (PY, "-u", "train.py", "a")


def test_argv_module():
    opts = LaunchOptions(user_script="pkg.train", user_args=("x",), module=True)
    assert worker_argv(opts, PY, 1) == (PY, "-u", "-m", "pkg.train", "--local_rank=1", "x")


def test_argv_no_python():
    opts = LaunchOptions(user_script="./run.sh", user_args=("x y",), no_python=True)
    assert worker_argv(opts, PY, 0) == ("./run.sh", "--local_rank=0", "x y")


def test_argv_no_python_no_local_rank():
    opts = LaunchOptions(user_script="./run.sh", no_python=True, no_local_rank=True)
    assert worker_argv(opts, PY, 3) == ("./run.sh",)


# --- build_plan ----------------------------------------------------------------------------


def test_plan_shape():
    plan = make_plan()
    assert (plan.run_id, plan.master_addr, plan.master_port, plan.world_size) == (
        "run-42", "node-a", 29512, 5)
    assert [(n.host, n.node_rank, n.local, n.cwd) for n in plan.nodes] == [
        ("node-a", 0, True, "/work/job"), ("node-b", 1, False, "/work/job")]
    assert [[(w.rank, w.local_rank) for w in n.workers] for n in plan.nodes] == [
        [(0, 0), (1, 1)], [(2, 0), (3, 1), (4, 2)]]


def test_env_contract_for_every_worker():
    plan = make_plan(restart_count=2)
    seen_ranks = []
    for node in plan.nodes:
        slots = {"node-a": "1,3", "node-b": "0,1,2"}[node.host]
        for worker in node.workers:
            env = worker_env(node, worker)
            assert env[contract.RANK] == str(worker.rank)
            assert env[contract.LOCAL_RANK] == str(worker.local_rank)
            assert env[contract.WORLD_SIZE] == "5"
            assert env[contract.LOCAL_WORLD_SIZE] == str(len(node.workers))
            assert env[contract.NODE_RANK] == str(node.node_rank)
            assert env[contract.MASTER_ADDR] == "node-a"
            assert env[contract.MASTER_PORT] == "29512"
            assert env[contract.CUDA_VISIBLE_DEVICES] == slots
            assert env[contract.RUN_ID] == "run-42"
            assert env[contract.RESTART_COUNT] == "2"
            assert worker.argv == (PY, "-u", "train.py", f"--local_rank={worker.local_rank}",
                                   "--lr", "0.1")
            seen_ranks.append(worker.rank)
    assert seen_ranks == [0, 1, 2, 3, 4]
    assert contract.RUN_ID == "DEEPSHARD_RUN_ID"
    assert contract.RESTART_COUNT == "DEEPSHARD_RESTART_COUNT"


def test_rank_variables_are_per_worker_not_per_node():
    node = make_plan().nodes[1]
    assert contract.RANK not in dict(node.env)
    assert contract.LOCAL_RANK not in dict(node.env)
    assert [dict(w.env) for w in node.workers] == [
        {"RANK": "2", "LOCAL_RANK": "0"},
        {"RANK": "3", "LOCAL_RANK": "1"},
        {"RANK": "4", "LOCAL_RANK": "2"},
    ]


def test_default_restart_count_is_zero():
    assert dict(make_plan().nodes[0].env)[contract.RESTART_COUNT] == "0"


def test_env_file_variables_are_exported_but_contract_wins():
    plan = make_plan(env_vars={"NCCL_DEBUG": "INFO", "WORLD_SIZE": "99", "MASTER_PORT": "1"})
    for node in plan.nodes:
        env = dict(node.env)
        assert env["NCCL_DEBUG"] == "INFO"
        assert env["WORLD_SIZE"] == "5"
        assert env["MASTER_PORT"] == "29512"


def test_options_carried_to_nodes():
    opts = LaunchOptions(user_script="t.py", log_dir="/logs", bind_cores_to_rank=True,
                         stop_grace=1.5)
    for node in make_plan(options=opts).nodes:
        assert (node.log_dir, node.bind_cores_to_rank, node.stop_grace) == ("/logs", True, 1.5)


# --- NodePlan JSON -------------------------------------------------------------------------


def test_node_plan_json_roundtrip():
    plan = make_plan(env_vars={"A": "x y", "B": "'\"$(id)\"'", "C": "caf\udce9\udcff"},
                     options=LaunchOptions(user_script="t.py", user_args=("\udcff", "ü"),
                                           log_dir="/l", stop_grace=0.25))
    for node in plan.nodes:
        text = node.to_json()
        assert "\n" not in text
        json.loads(text)  # valid JSON
        text.encode("utf-8")  # lone surrogates are escaped, so it can go down a pipe
        back = NodePlan.from_json(text)
        assert back == node
        assert isinstance(back.env, tuple) and all(isinstance(kv, tuple) for kv in back.env)
        assert isinstance(back.workers[0].argv, tuple)
    assert dict(NodePlan.from_json(plan.nodes[0].to_json()).env)["C"] == "caf\udce9\udcff"


_env_text = st.text(max_size=20)  # includes lone surrogates (category Cs)


@given(env=st.lists(st.tuples(_env_text, _env_text), max_size=6),
       argv=st.lists(_env_text, max_size=4),
       log_dir=st.none() | _env_text, local=st.booleans(),
       grace=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_node_plan_json_roundtrip_property(env, argv, log_dir, local, grace):
    node = NodePlan(host="h", node_rank=3, local=local, cwd="/c", env=tuple(env),
                    workers=(WorkerPlan(7, 0, tuple(argv), (("RANK", "7"),)),),
                    log_dir=log_dir, bind_cores_to_rank=local, stop_grace=grace)
    assert NodePlan.from_json(node.to_json()) == node


# --- render --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "token", "MY_Token_X", "AWS_SECRET_ACCESS_KEY", "api_key", "KEYRING",
    "SECRET", "client_secret", "DB_PASSWORD", "Password2",
])
def test_is_secret(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["PATH", "NCCL_DEBUG", "MASTER_ADDR", "PASSWD", "TOKE", "KE_Y",
                                  "SECRT", ""])
def test_is_not_secret(name):
    assert not is_secret(name)


def test_shown_env_masks_and_quotes():
    env = (("HF_TOKEN", "hf_abc"), ("NCCL_DEBUG", "INFO"), ("X", "a b; rm -rf /"),
           ("db_password", "pw"), ("EMPTY", ""))
    assert shown_env(env) == [
        f"HF_TOKEN={MASK}", "NCCL_DEBUG=INFO", "X='a b; rm -rf /'", f"db_password={MASK}",
        "EMPTY=''"]


def render(plan) -> str:
    stream = io.StringIO()
    render_plan(plan, stream)
    return stream.getvalue()


def test_render_plan_masks_secrets_and_shows_the_rest():
    plan = make_plan(env_vars={"HF_TOKEN": "hf_s3cr3tvalue", "WANDB_API_KEY": "wandbs3cr3t",
                               "Db_Password": "hunter2pw", "NCCL_DEBUG": "INFO"})
    out = render(plan)
    for secret in ("hf_s3cr3tvalue", "wandbs3cr3t", "hunter2pw"):
        assert secret not in out
    assert f"HF_TOKEN={MASK}" in out and f"WANDB_API_KEY={MASK}" in out
    assert "NCCL_DEBUG=INFO" in out
    assert "run-42" in out and "node-a:29512" in out
    assert "5 worker(s) on 2 node(s)" in out
    assert "CUDA_VISIBLE_DEVICES=1,3" in out and "CUDA_VISIBLE_DEVICES=0,1,2" in out
    assert "--local_rank=0" in out
    assert "this machine" in out and "remote" in out


@pytest.mark.parametrize("arg", ["--tags=[bold]x", "model.layers=[a,b]", "--pattern=[/x]"])
def test_render_plan_shows_user_args_literally(arg):
    # BUG: render_plan puts shlex.join(argv) into a rich Table cell with markup enabled, so
    # "[bold]"/"[a,b]" vanish from the printed command and "[/x]" raises MarkupError.
    opts = LaunchOptions(user_script="t.py", user_args=(arg,))
    out = render(make_plan(options=opts, slots={"node-a": (0,)}))
    assert arg in out
