"""The csv_monitor writes DeepSpeed 0.19.8's files byte for byte: one file per event name,
``step,<last part of the name>`` header once per process, ``\\r\\n`` line ends (Python's
csv module), floats as Python's repr; only global rank 0 writes."""

from __future__ import annotations

from deepshard.monitor.config import get_monitor_config
from deepshard.monitor.csv_monitor import csvMonitor
from deepshard.monitor.monitor import MonitorMaster


def csv_config(tmp_path, **extra):
    return get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                               "job_name": "job", **extra}})


def test_one_file_per_name_with_deepspeeds_bytes(tmp_path):
    master = MonitorMaster(csv_config(tmp_path), rank=0)
    master.write_events([("Train/Samples/lr", 0.0001, 8), ("Train/Samples/loss_scale", 65536, 8)])
    master.write_events([("Train/Samples/lr", 0.0006678367782143116, 16),
                         ("Train/Samples/loss_scale", 32768.0, 16)])
    master.write_events([("Eval loss", 1 / 3, 16)])
    job = tmp_path / "job"
    assert sorted(p.name for p in job.iterdir()) == [
        "Eval_loss.csv", "Train_Samples_loss_scale.csv", "Train_Samples_lr.csv"]
    assert (job / "Train_Samples_lr.csv").read_bytes() == (
        b"step,lr\r\n8,0.0001\r\n16,0.0006678367782143116\r\n")
    assert (job / "Train_Samples_loss_scale.csv").read_bytes() == (
        b"step,loss_scale\r\n8,65536\r\n16,32768.0\r\n")
    assert (job / "Eval_loss.csv").read_bytes() == b"step,Eval loss\r\n16,0.3333333333333333\r\n"


def test_a_new_process_appends_with_a_header_again(tmp_path):
    """DeepSpeed opens with 'a+' and writes the header once per monitor object, so a
    restarted job appends a second header: kept, so that files compare equal."""
    for step in (4, 8):
        monitor = csvMonitor(csv_config(tmp_path).csv_monitor)
        monitor.write_events([("Train/Samples/lr", 0.5, step)])
    assert (tmp_path / "job" / "Train_Samples_lr.csv").read_bytes() == (
        b"step,lr\r\n4,0.5\r\nstep,lr\r\n8,0.5\r\n")


def test_only_rank_0_writes(tmp_path):
    master = MonitorMaster(csv_config(tmp_path), rank=1)
    assert master.enabled and master.monitors == []
    master.write_events([("Train/Samples/lr", 0.1, 4)])
    assert not (tmp_path / "job").exists()


def test_defaults_are_deepspeeds(tmp_path, monkeypatch):
    cfg = get_monitor_config({"csv_monitor": {"enabled": True}})
    assert (cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == ("", "DeepSpeedJobName")
    assert (cfg.tensorboard.output_path, cfg.tensorboard.job_name) == ("", "DeepSpeedJobName")
    assert (cfg.wandb.project, cfg.wandb.team, cfg.wandb.group) == ("deepspeed", None, None)
    assert (cfg.comet.samples_log_interval, cfg.comet.online, cfg.comet.mode) == (100, None, None)
    assert cfg.enabled and not get_monitor_config({}).enabled
    monkeypatch.chdir(tmp_path)  # output_path "": the job's directory in the working one
    MonitorMaster(cfg, rank=0).write_events([("Train/Samples/lr", 0.1, 4)])
    assert (tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv").is_file()
