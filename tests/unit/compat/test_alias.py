"""``ds-run --deepspeed_compat``: the ``deepspeed`` shim (deepshard.compat).

The shim changes the interpreter it runs in (``sys.modules``, ``sys.meta_path``, the
exception hooks), so each case runs in a fresh Python with the shim directory on its
``PYTHONPATH``, as a worker under ``--deepspeed_compat`` gets it.
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepshard import contract
from deepshard.compat import distribution, paths
from deepshard.compat.alias import real_deepspeed, resolve, target_name
from deepshard.compat.missing import (
    ATTRIBUTES,
    MODULES,
    MissingDeepSpeedAttribute,
    MissingDeepSpeedModule,
    attribute_error,
    lookup,
    module_error,
)
from deepshard.contract import SHIM_DIR, prepend_to_path
from deepshard.errors import UsageError
from deepshard.launcher.options import LaunchOptions
from deepshard.launcher.placement import place
from deepshard.launcher.plan import NodePlan, build_plan
from deepshard.launcher.plan_render import render_plan
from deepshard.launcher.resources import Host, Resources


def run_py(code: str, tmp_path: Path, *extra_path: str, env: dict[str, str] | None = None):
    """``code`` in a fresh Python whose PYTHONPATH is the shim, then ``extra_path``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK")}
    environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *extra_path])
    environ.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          env=environ, capture_output=True, text=True, timeout=120)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


# --- in a worker's interpreter ---------------------------------------------------------------


def test_import_deepspeed_is_deepshard_without_torch(tmp_path):
    out = ok(run_py("""
        import sys
        import deepspeed
        import deepshard
        assert deepspeed is deepshard, deepspeed
        assert sys.modules["deepspeed"] is deepshard
        import importlib.metadata
        print("torch" in sys.modules, deepspeed.__name__, deepspeed.__version__,
              importlib.metadata.version("deepspeed"), deepspeed.__version_major__)
    """, tmp_path))
    presented = f"0.19.8+deepshard.{__import__('deepshard').__version__}"
    assert out.split() == ["False", "deepshard", presented, presented, "0"]


def test_submodules_are_the_same_module_objects(tmp_path):
    ok(run_py("""
        import sys
        from deepspeed.runtime.lr_schedules import WarmupLR
        import deepspeed.runtime.lr_schedules as ds_mod
        import deepshard.runtime.lr_schedules as mod
        assert WarmupLR is mod.WarmupLR
        assert ds_mod is mod is sys.modules["deepspeed.runtime.lr_schedules"]
        assert sys.modules["deepspeed.runtime"] is sys.modules["deepshard.runtime"]
        # the module keeps its own identity: spec, name, file
        assert mod.__spec__.name == mod.__name__ == "deepshard.runtime.lr_schedules"
        assert sys.modules["deepshard.runtime"].__spec__.name == "deepshard.runtime"
    """, tmp_path))


def test_attribute_modules_resolve_through_deepshards_table(tmp_path):
    """``deepshard.zero``/``deepshard.checkpointing`` are attributes (deepshard._MODULES),
    not subpackages: ``from deepspeed.zero import Init`` must still work."""
    ok(run_py("""
        import deepspeed, deepshard
        from deepspeed.zero import Init
        import deepspeed.zero
        import deepspeed.checkpointing
        assert Init is deepshard.zero.Init
        assert deepspeed.zero is deepshard.zero
        assert deepspeed.checkpointing is deepshard.checkpointing
    """, tmp_path))


def test_built_packages_offer_the_table_rows(tmp_path):
    """``deepspeed.pipe`` and ``deepspeed.utils`` are no deepshard modules: the alias builds
    them from the path table's name rows, and their submodules are the table's modules."""
    ok(run_py("""
        import deepspeed, deepshard
        import deepspeed.runtime.pipe.engine
        from deepspeed.pipe import LayerSpec, PipelineModule
        from deepspeed.utils import log_dist, safe_get_full_grad
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepshard.runtime.parallel import pipe_engine, pipe_module
        from deepshard.runtime.checkpoint import zero_to_fp32
        assert PipelineModule is pipe_module.PipelineModule is deepshard.PipelineModule
        assert deepspeed.pipe.LayerSpec is LayerSpec is deepspeed.runtime.pipe.LayerSpec
        assert deepspeed.runtime.pipe.engine is pipe_engine
        assert deepspeed.utils.zero_to_fp32 is zero_to_fp32
        assert (get_fp32_state_dict_from_zero_checkpoint
                is zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint)
        assert log_dist is deepshard.log_dist
        assert ZeroParamStatus.INFLIGHT.value == 3
        assert "PipelineModule" in deepspeed.pipe.__all__
        assert not hasattr(deepspeed.pipe, "NoSuchName")
    """, tmp_path))


def test_from_deepspeed_import_the_api(tmp_path):
    ok(run_py("""
        import deepshard
        from deepspeed import initialize, init_distributed, zero
        assert initialize is deepshard.initialize
        assert init_distributed is deepshard.init_distributed
        assert zero is deepshard.zero
    """, tmp_path))


def test_missing_module_is_one_line_and_exit_2(tmp_path):
    result = run_py("import deepspeed.ops.transformer", tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("deepshard: error: deepspeed.ops.transformer: no deepshard "
                               "counterpart for the fused DeepSpeedTransformerLayer")
    assert "HINT: " in lines[0] and "deepshard.kernels" in lines[0]


def test_missing_zero_stage_names_the_config_key(tmp_path):
    result = run_py("from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer",
                    tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "zero_optimization.stage" in result.stderr


def test_unknown_module_gets_the_generic_line(tmp_path):
    result = run_py("import deepspeed.no_such_thing", tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "deepshard: error: deepspeed.no_such_thing: no deepshard counterpart for this "
        "DeepSpeed module (under --deepspeed_compat, deepspeed is deepshard). HINT: run "
        "without --deepspeed_compat to use DeepSpeed itself"]


def test_missing_module_is_an_import_error_scripts_can_catch(tmp_path):
    out = ok(run_py("""
        from deepshard.errors import UsageError
        try:
            import deepspeed.ops.aio
        except ImportError as exc:
            assert isinstance(exc, ModuleNotFoundError) and isinstance(exc, UsageError)
            print(exc.name)
        try:
            import deepspeed.inference.v2
        except ModuleNotFoundError as exc:
            print(exc.name)
        from deepspeed.inference.engine import InferenceEngine
        import deepshard.inference.engine as mine
        print(InferenceEngine is mine.InferenceEngine)
    """, tmp_path))
    assert out.split()[0] == "deepspeed.ops.aio"  # deepspeed.ops is a table row
    assert out.split()[1] == "deepspeed.inference.v2"  # FastGen; deepspeed.inference is built
    assert out.split()[2] == "True"


def test_missing_top_level_name_is_one_line(tmp_path):
    result = run_py("import deepspeed\ndeepspeed.DeepSpeedTransformerLayer", tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "deepshard: error: deepspeed.DeepSpeedTransformerLayer: no deepshard counterpart for "
        "the fused DeepSpeedTransformerLayer (under --deepspeed_compat, deepspeed is "
        "deepshard). HINT: " + ATTRIBUTES["DeepSpeedTransformerLayer"].instead]


def test_missing_names_keep_hasattr_false(tmp_path):
    out = ok(run_py("""
        import deepspeed
        print(hasattr(deepspeed, "DeepSpeedTransformerLayer"), hasattr(deepspeed, "no_such_name"),
              getattr(deepspeed, "DeepSpeedHybridEngine", "default"),
              hasattr(deepspeed, "initialize"), hasattr(deepspeed, "init_inference"))
    """, tmp_path))
    assert out.split() == ["False", "False", "default", "True", "True"]


def test_hf_and_accelerate_see_a_deepspeed_distribution_that_names_deepshard(tmp_path):
    """They ask find_spec, then importlib.metadata: the shim's directory holds a
    ``deepspeed`` distribution whose version is DeepSpeed's with deepshard's as local label
    and whose summary says what it is."""
    out = ok(run_py("""
        import importlib.metadata, importlib.util
        dist = importlib.metadata.distribution("deepspeed")
        print(dist.version, importlib.metadata.version("deepspeed"))
        print("deepspeed" in importlib.metadata.packages_distributions())
        print(dist.metadata["Summary"])
    """, tmp_path))
    versions, listed, summary = out.splitlines()
    assert versions.split() == [distribution.version(), distribution.version()]
    assert listed == "True" and summary == contract.COMPAT_SUMMARY


def test_a_plain_environment_has_no_deepspeed_distribution(tmp_path):
    """``pip install deepshard`` presents nothing: only the compat path (the shim's directory
    first on the path) or ``ds-compat install`` does."""
    code = ("import importlib.metadata\n"
            "try:\n    importlib.metadata.version('deepspeed')\n"
            "except importlib.metadata.PackageNotFoundError:\n    print('absent')\n")
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "absent", out.stdout + out.stderr


def test_the_shim_s_sitecustomize_adopts_and_runs_the_one_it_shadows(tmp_path):
    """Workers start with the transformers hook's finder installed (no transformers, no
    torch imported), and a ``sitecustomize`` later on the path still runs."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_RAN = True\n")
    code = ("import sys, builtins\n"
            "from deepshard.compat import transformers_hook as h\n"
            "print(any(isinstance(f, h._Finder) for f in sys.meta_path),\n"
            "      getattr(builtins, 'OTHER_RAN', False), 'torch' in sys.modules,\n"
            "      'transformers' in sys.modules)\n")
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([SHIM_DIR, str(other)]))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "False", "False"], out.stderr


def test_the_shipped_dist_info_is_the_distribution_module_s():
    """The static ``.dist-info`` beside the shim (package data) says what
    :mod:`deepshard.compat.distribution` says, under the name it computes."""
    (info,) = Path(SHIM_DIR).glob("*.dist-info")
    assert info.name == distribution.dist_info_name()
    assert (info / "METADATA").read_text() == distribution.metadata_text()
    assert (info / "top_level.txt").read_text() == "deepspeed\n"
    assert not list(Path(SHIM_DIR).glob("*.egg-info"))


def fake_deepspeed(root: Path) -> Path:
    package = root / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise SystemExit('the real DeepSpeed was imported')\n")
    return root


def test_a_real_deepspeed_later_on_the_path_loses_with_one_warning(tmp_path):
    site = fake_deepspeed(tmp_path / "site")
    result = run_py("""
        import deepspeed, deepshard
        import deepspeed.runtime.lr_schedules
        from deepspeed.zero import Init
        assert deepspeed is deepshard
        print("ok")
    """, tmp_path, str(site))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "`import deepspeed` is deepshard" in lines[0]
    assert str(site / "deepspeed") in lines[0]


def test_the_warning_is_rank_0s_only(tmp_path):
    site = fake_deepspeed(tmp_path / "site")
    result = run_py("import deepspeed", tmp_path, str(site), env={"RANK": "1"})
    assert result.returncode == 0 and result.stderr == ""


def test_no_warning_without_a_real_deepspeed(tmp_path):
    assert run_py("import deepspeed", tmp_path).stderr == ""


def test_imported_under_its_package_name_the_shim_does_nothing(tmp_path):
    out = ok(run_py("""
        import sys
        import deepshard.compat.shim.deepspeed
        print("deepspeed" in sys.modules, len(sys.meta_path))
    """, tmp_path, env={"PYTHONPATH": ""}))
    assert out.split()[0] == "False"


# --- the pure parts --------------------------------------------------------------------------


def test_target_names():
    assert target_name("deepspeed") == "deepshard"
    assert target_name("deepspeed.runtime.lr_schedules") == "deepshard.runtime.lr_schedules"
    assert target_name("deepspeed.zero") == "deepshard.runtime.zero"
    assert target_name("deepspeed.zero.init") == "deepshard.runtime.zero.init"
    assert target_name("deepspeed.checkpointing") == "deepshard.runtime.activation_checkpointing"
    assert target_name("deepspeed.runtime.pipe.module") == "deepshard.runtime.parallel.pipe_module"
    with pytest.raises(ValueError):
        target_name("torch.nn")


def test_every_row_of_the_path_table_resolves():
    """Each module row names an existing deepshard module, each name row an existing object,
    and :func:`resolve` finds them all without installing the alias."""
    for alias, module in paths.MODULES.items():
        assert resolve(alias) is importlib.import_module(module), alias
    for package, rows in paths.NAMES.items():
        for name, row in rows.items():
            where, attribute = paths.split_row(row)
            assert resolve(f"{package}.{name}") is getattr(importlib.import_module(where),
                                                           attribute), (package, name)
    assert "deepspeed" not in sys.modules
    with pytest.raises(LookupError):
        resolve("deepspeed.pipe.NoSuchName")


def test_lookup_takes_the_longest_listed_prefix():
    assert lookup("deepspeed.ops.transformer.inference") is MODULES["deepspeed.ops.transformer"]
    assert lookup("deepspeed.ops.lamb.fused") is MODULES["deepspeed.ops"]
    assert lookup("deepspeed.runtime.fp16.fused_optimizer") is MODULES[
        "deepspeed.runtime.fp16"]
    assert lookup("deepspeed.opsx") is None
    assert lookup("deepspeed") is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_listed_module_renders_one_line(name):
    err = module_error(name)
    assert isinstance(err, ModuleNotFoundError) and isinstance(err, UsageError)
    assert isinstance(err, MissingDeepSpeedModule)
    assert err.name == name and err.where == name
    line = str(err)
    assert "\n" not in line and line.startswith(f"{name}: ") and ". HINT: " in line


@pytest.mark.parametrize("name", sorted(ATTRIBUTES))
def test_every_listed_attribute_renders_one_line(name):
    err = attribute_error(name)
    assert isinstance(err, MissingDeepSpeedAttribute) and isinstance(err, AttributeError)
    assert str(err).startswith(f"deepspeed.{name}: ") and "\n" not in str(err)


def test_unlisted_attribute_gets_no_special_error():
    assert attribute_error("__wrapped__") is None


def test_table_names_are_deepspeed_modules():
    assert all(n.startswith("deepspeed.") for n in MODULES)


def test_prepend_to_path():
    sep = os.pathsep
    assert prepend_to_path("/shim", None) == "/shim"
    assert prepend_to_path("/shim", "") == "/shim"
    assert prepend_to_path("/shim", f"/a{sep}/b") == f"/shim{sep}/a{sep}/b"
    assert prepend_to_path("/shim", f"/a{sep}/shim{sep}{sep}/b") == f"/shim{sep}/a{sep}/b"


def test_real_deepspeed_leaves_the_shim_out(tmp_path):
    assert real_deepspeed(SHIM_DIR, [SHIM_DIR]) is None
    site = fake_deepspeed(tmp_path / "site")
    assert real_deepspeed(SHIM_DIR, [SHIM_DIR, str(site)]) == str(site / "deepspeed")


# --- through the plan ------------------------------------------------------------------------


def compat_plan(local: bool = True):
    options = LaunchOptions(user_script="train.py", deepspeed_compat=True)
    res = Resources((Host("node-a", (0, 1)),), "hf")
    return build_plan(options, place(res), {}, python="/usr/bin/python3", cwd="/job",
                      master_addr="node-a", master_port=29500, run_id="r",
                      is_local={"node-a": local})


def test_the_flag_travels_to_the_agent():
    node = compat_plan().nodes[0]
    assert node.deepspeed_compat
    assert NodePlan.from_json(node.to_json()) == node
    # the shim path is the agent's to resolve: nothing in the plan's environment
    assert "PYTHONPATH" not in dict(node.env)
    plain = build_plan(LaunchOptions(user_script="train.py"),
                       place(Resources((Host("a", (0,)),), "hf")), {}, python="p", cwd="/",
                       master_addr="a", master_port=1, run_id="r", is_local={"a": True})
    assert not plain.nodes[0].deepspeed_compat


@pytest.mark.parametrize("local", [True, False])
def test_dry_run_shows_the_shim_on_the_path(local):
    out = io.StringIO()
    render_plan(compat_plan(local), out)
    text = out.getvalue()
    shown = SHIM_DIR if local else "<deepshard/compat/shim on that host>"
    assert f"PYTHONPATH={shown}:<its PYTHONPATH> (--deepspeed_compat" in text
