"""Every DeepSpeed name the installed HF ecosystem uses resolves under ``--deepspeed_compat``.

transformers, accelerate, peft and trl reach into DeepSpeed by dotted name
(``deepspeed.zero.GatheredParameters``, ``from deepspeed.utils import groups``). Their source
is read, not imported (:mod:`tests.unit.compat.ecosystem_names`), and each name they use must
be a deepshard object under the alias: :func:`deepshard.compat.alias.resolve` for what the path
table answers, then plain attribute lookup for the rest of the chain
(``...ulysses_sp.UlyssesSPAttentionHF.register_with_transformers``). One test checks, in a
worker's interpreter with the shim installed, that this agrees with what ``import`` and
attribute access actually give there.

A name that should not resolve goes in :data:`EXCLUDED` with the reason; it is then a strict
xfail, so an exclusion that stops being needed fails until it is removed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from deepshard.compat.audit import collect_package, collect_source, package_names, resolve_dotted
from deepshard.contract import SHIM_DIR

PACKAGES = ("transformers", "accelerate", "peft", "trl", "lightning")

EXCLUDED: dict[str, str] = {
    "deepspeed.utils.is_initialized":
        "not a DeepSpeed 0.19.8 name; transformers' esmfold reaches it only when DeepSpeed is "
        "not importable (inverted is_deepspeed_available check) and catches any exception",
}
"""DeepSpeed names the ecosystem uses that deepshard does not and should not provide."""


# --- collecting ------------------------------------------------------------------------------


@functools.cache
def _cases() -> list[Any]:
    cases: list[Any] = []
    for package in PACKAGES:
        names = package_names(package)
        if names is None:
            cases.append(pytest.param(package, None, id=f"{package}-not-installed",
                                      marks=pytest.mark.skip(reason=f"{package} not installed")))
            continue
        for name in names:
            marks = ([pytest.mark.xfail(reason=EXCLUDED[name], strict=True)]
                     if name in EXCLUDED else [])
            cases.append(pytest.param(package, name, id=f"{package}:{name}", marks=marks))
    return cases


# --- resolving -------------------------------------------------------------------------------


@pytest.mark.parametrize(("package", "name"), _cases())
def test_ecosystem_name_resolves_under_the_alias(package, name):
    site = package_names(package)[name][0]
    try:
        found = resolve_dotted(name)
    except (LookupError, AttributeError) as exc:
        pytest.fail(f"{name} (used at {site}) does not resolve under --deepspeed_compat: {exc}")
    assert found is not None, f"{name} (used at {site}) resolves to None"


def test_resolve_agrees_with_the_installed_alias(tmp_path):
    """In a worker's interpreter (the shim first on PYTHONPATH), ``import`` of the longest
    importable prefix and ``getattr`` along the rest find exactly the names
    :func:`resolve_dotted` finds."""
    names = sorted({name for package in PACKAGES for name in package_names(package) or {}})
    if not names:
        pytest.skip("none of transformers, accelerate, peft, trl is installed")
    code = textwrap.dedent("""
        import importlib, json, sys
        import deepspeed
        found = {}
        for name in json.load(sys.stdin):
            parts = name.split(".")
            for end in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:end]))
                    break
                except ImportError:
                    pass
            try:
                for attribute in parts[end:]:
                    obj = getattr(obj, attribute)
                found[name] = obj is not None
            except AttributeError:
                found[name] = False
        print(json.dumps(found))
    """)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK")}
    environ["PYTHONPATH"] = SHIM_DIR
    result = subprocess.run([sys.executable, "-c", code], input=json.dumps(names), cwd=tmp_path,
                            env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    under_alias = json.loads(result.stdout.splitlines()[-1])

    def by_resolve(name: str) -> bool:
        try:
            return resolve_dotted(name) is not None
        except (LookupError, AttributeError):
            return False

    disagree = {name: under_alias[name] for name in names if by_resolve(name) != under_alias[name]}
    assert not disagree, f"installed alias resolves (True) / fails (False) otherwise: {disagree}"


def test_exclusions_are_still_used_and_explained():
    if any(package_names(package) is None for package in PACKAGES):
        pytest.skip("an exclusion's user may simply not be installed")
    used = {name for package in PACKAGES for name in package_names(package) or {}}
    assert sorted(set(EXCLUDED) - used) == [], "no installed package uses these any more"
    for name, reason in EXCLUDED.items():
        assert reason.strip() and "\n" not in reason, name


# --- the collector ---------------------------------------------------------------------------

SOURCE = '''
import os
import deepspeed
import deepspeed.comm
import deepspeed.runtime.utils as ds_utils
from deepspeed import zero, comm as dist
from deepspeed.runtime.zero import partition_parameters as pp
from .deepspeed import local_thing

deepspeed.zero.GatheredParameters([], modifier_rank=0)
deepspeed.utils.logger.info("x")
deepspeed.accelerator.get_accelerator().device_name()
pp.zero_wrapper_for_fp_tensor_constructor = None
x = os.path.join(dist.get_rank(), ds_utils.see_memory_usage)
local_thing.attribute

def load():
    from deepspeed.utils import groups as g
    return g._get_sequence_parallel_group(), zero.Init

def shadowed(deepspeed):
    return deepspeed.not_a_deepspeed_name

def also_shadowed():
    import torch.distributed as dist
    return dist.barrier

class Holder:
    from deepspeed.ops.adam import FusedAdam as Adam
    optimizer = Adam.step
    def method(self):
        return Adam.not_seen_from_a_method
'''


def test_collector_finds_imports_aliases_chains_and_local_imports():
    found = collect_source(SOURCE, "pkg/mod.py")
    assert list(found) == sorted(found)
    assert found == {
        "deepspeed": ["pkg/mod.py:3"],
        "deepspeed.accelerator.get_accelerator": ["pkg/mod.py:12"],
        "deepspeed.comm": ["pkg/mod.py:4", "pkg/mod.py:6"],
        "deepspeed.comm.get_rank": ["pkg/mod.py:14"],
        "deepspeed.ops.adam.FusedAdam": ["pkg/mod.py:29"],
        "deepspeed.ops.adam.FusedAdam.step": ["pkg/mod.py:30"],
        "deepspeed.runtime.utils": ["pkg/mod.py:5"],
        "deepspeed.runtime.utils.see_memory_usage": ["pkg/mod.py:14"],
        "deepspeed.runtime.zero.partition_parameters": ["pkg/mod.py:7"],
        "deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor":
            ["pkg/mod.py:13"],
        "deepspeed.utils.groups": ["pkg/mod.py:18"],
        "deepspeed.utils.groups._get_sequence_parallel_group": ["pkg/mod.py:19"],
        "deepspeed.utils.logger.info": ["pkg/mod.py:11"],
        "deepspeed.zero": ["pkg/mod.py:6"],
        "deepspeed.zero.GatheredParameters": ["pkg/mod.py:10"],
        "deepspeed.zero.Init": ["pkg/mod.py:19"],
    }


def test_collect_package_walks_files_and_names_sites_from_the_package(tmp_path):
    package = tmp_path / "tool"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("import os\n")
    (package / "sub" / "ds.py").write_text("import deepspeed\n\ndeepspeed.initialize\n")
    (package / "sub" / "zero.py").write_text("from deepspeed import zero\nzero.Init\n")
    assert collect_package(package) == {
        "deepspeed": ["tool/sub/ds.py:1"],
        "deepspeed.initialize": ["tool/sub/ds.py:3"],
        "deepspeed.zero": ["tool/sub/zero.py:1"],
        "deepspeed.zero.Init": ["tool/sub/zero.py:2"],
    }


def test_the_audit_command_lists_names_and_exits_1_on_a_missing_one(tmp_path, capsys):
    from deepshard.compat.audit import main

    script = tmp_path / "train.py"
    script.write_text("import deepspeed\nfrom deepspeed.zero import Init\n"
                      "deepspeed.not_a_deepspeed_name()\n")
    assert main([str(script)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{script}: ok      deepspeed.zero.Init" in out
    assert any("MISSING deepspeed.not_a_deepspeed_name" in line and "train.py:3" in line
               for line in out)
    assert out[-1] == f"{script}: 3 names, 2 resolve, 1 do not"
    assert main([str(tmp_path / "absent.py")]) == 2
