"""The ``comms_logger`` section: DeepSpeed's keys and defaults, one-line errors, and how
configure / configure_from_config apply it to the logger."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepshard.comm.config import CommsLoggerConfig
from deepshard.comm.settings import configure, configure_from_config
from deepshard.config.schema_base import KeyLog, Section, doc
from deepshard.errors import UsageError


def test_defaults_are_deepspeeds():
    cfg = CommsLoggerConfig()
    assert (cfg.enabled, cfg.verbose, cfg.prof_all, cfg.debug, cfg.prof_ops) == (
        False, False, True, False, ())


@pytest.mark.parametrize(("section", "where", "fragment"), [
    ({"prof_al": True}, "comms_logger.prof_al", "did you mean 'prof_all'"),
    ({"colour": 1}, "comms_logger.colour", "unknown key"),
    ({"enabled": "yes"}, "comms_logger.enabled", "expected true or false"),
    ({"prof_ops": "all_reduce"}, "comms_logger.prof_ops", "expected a list of op names"),
])
def test_mistakes_are_one_line_usage_errors(section, where, fragment):
    with pytest.raises(UsageError) as err:
        configure_from_config(section)
    text = str(err.value)
    assert text.startswith(f"{where}: ") and fragment in text and "HINT:" in text
    assert "\n" not in text


def test_inside_a_config_schema_errors_carry_its_path():
    class Top(Section):
        comms_logger: CommsLoggerConfig = doc("x", default_factory=CommsLoggerConfig)

    assert Top.model_validate({"comms_logger": {"enabled": 1}}).comms_logger.enabled
    with pytest.raises(UsageError, match=r"^ds.json: comms_logger.enabld: unknown key"):
        Top.model_validate({"comms_logger": {"enabld": True}},
                           context={"keys": KeyLog(origin="ds.json")})
    with pytest.raises(UsageError, match=r"comms_logger.verbose: expected true or false"):
        Top.model_validate({"comms_logger": {"verbose": "loud"}})


def test_configure_from_config_sets_every_key(restore_comms_logger):
    log = restore_comms_logger
    configure_from_config({"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"],
                           "verbose": True, "debug": True})
    assert (log.enabled, log.prof_all, log.prof_ops, log.verbose, log.debug) == (
        True, False, ["all_reduce"], True, True)
    configure_from_config(CommsLoggerConfig())  # a model; left-out keys: the defaults
    assert (log.enabled, log.prof_all, log.prof_ops) == (False, True, [])


def test_enabled_false_in_the_section_keeps_the_logger_off(restore_comms_logger):
    """DeepSpeed 0.19.8 turns the logger on for any comms_logger section; deepshard reads
    ``enabled``."""
    configure(deepspeed_config={"comms_logger": {"enabled": False}})
    assert not restore_comms_logger.enabled


def test_configure_keywords_and_configs_without_the_section(restore_comms_logger):
    log = restore_comms_logger
    configure(enabled=True, prof_ops=("broadcast",))
    assert log.enabled and log.prof_ops == ["broadcast"]
    configure(deepspeed_config={"train_batch_size": 8})  # no section: left as it was
    assert log.enabled

    class Top(Section):
        comms_logger: CommsLoggerConfig = doc("x", default_factory=CommsLoggerConfig)

    configure(deepspeed_config=Top.model_validate({}))  # the schema's default: not given
    assert log.enabled
    configure(deepspeed_config=Top.model_validate({"comms_logger": {"prof_all": False}}))
    assert not log.enabled and not log.prof_all


def test_the_config_module_imports_no_torch():
    code = ("import sys, deepshard.comm.config, deepshard.comm; "
            "deepshard.comm.CommsLoggerConfig; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
