"""The comet monitor, offline (``online: false``, no network): a real experiment's
metrics read back from its offline archive, logged every ``samples_log_interval``
samples per name, and no process left once the job has ended."""

from __future__ import annotations

import json
import zipfile

import pytest

from tests.unit.monitor.common import processes_left, run_python
from tests.unit.monitor.train_snippet import BASE, printed_steps, train_code

pytest.importorskip("comet_ml", reason="comet_ml is in the test extra")


def test_offline_experiment_logs_deepspeeds_events_and_leaves_no_process(tmp_path):
    config = {**BASE, "comet": {"enabled": True, "online": False, "project": "proj",
                                "experiment_name": "exp", "samples_log_interval": 4}}
    result = run_python(train_code(config), tmp_path, {
        "COMET_OFFLINE_DIRECTORY": str(tmp_path / "offline"),
        "COMET_DISABLE_AUTO_LOGGING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes_left(tmp_path) == []
    (archive,) = (tmp_path / "offline").glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").splitlines()]
        experiment = json.loads(z.read("experiment.json"))
    assert experiment["project_name"] == "proj"
    metrics = {}
    for m in messages:
        if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"].startswith(
                "Train/"):
            metric = m["payload"]["metric"]
            metrics.setdefault(metric["metricName"], []).append(
                (metric["step"], metric["metricValue"]))
    steps = printed_steps(result.stdout)  # samples 2, 4, 6: logged at 2 and 6 (interval 4)
    logged = [steps[0], steps[2]]
    assert metrics["Train/Samples/lr"] == [(s, lr) for s, _, lr in logged]
    assert [s for s, _ in metrics["Train/Samples/train_loss"]] == [2, 6]
    for (_, value), (_, loss, _) in zip(metrics["Train/Samples/train_loss"], logged,
                                        strict=True):
        assert value == pytest.approx(loss, rel=1e-6)


def test_online_without_an_api_key_is_one_line_and_exit_code_2(tmp_path):
    config = {**BASE, "comet": {"enabled": True}}
    result = run_python(train_code(config), tmp_path, {"COMET_DISABLE_AUTO_LOGGING": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "deepshard: error" in line]
    assert line.startswith("deepshard: error: comet.enabled: comet could not start an "
                           "experiment: Comet.ml requires an API key")
    assert "comet.online to false" in line and "Traceback" not in result.stderr
    assert processes_left(tmp_path) == []
