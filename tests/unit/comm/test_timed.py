"""``timed_op`` without a process group: what it records, under which name, when."""

from __future__ import annotations

import torch

from deepshard.comm.p2p import P2POp, isend
from deepshard.comm.timed import message_size, timed_op


class Work:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


@timed_op
def all_reduce(tensor, op=None, group=None, async_op=False, prof=False, log_name="all_reduce",
               debug=None):
    return Work() if async_op else None


def caller_of_the_op():
    all_reduce(torch.zeros(4))


def test_off_records_nothing(restore_comms_logger):
    all_reduce(torch.zeros(4))
    assert not restore_comms_logger.has_data()


def test_on_records_size_count_and_log_name(restore_comms_logger):
    log = restore_comms_logger
    log.enabled = True
    all_reduce(torch.zeros(4))
    all_reduce(tensor=torch.zeros(4, dtype=torch.float64), log_name="grads")
    raw = log.get_raw_data()
    assert list(raw) == ["all_reduce", "grads"]
    assert raw["all_reduce"][16][0] == 1 and raw["grads"][32][0] == 1
    assert all(lat >= 0 for lat in raw["all_reduce"][16][1])


def test_async_work_is_waited_inside_the_timed_region_on_a_cpu(restore_comms_logger):
    restore_comms_logger.enabled = True
    work = all_reduce(torch.zeros(1), async_op=True)
    assert work.waited == 1  # the caller's own wait() then returns at once
    restore_comms_logger.enabled = False
    assert all_reduce(torch.zeros(1), async_op=True).waited == 0


def test_prof_ops_and_prof_filter(restore_comms_logger):
    log = restore_comms_logger
    log.enabled, log.prof_all, log.prof_ops = True, False, ["wanted"]
    all_reduce(torch.zeros(1))
    all_reduce(torch.zeros(1), log_name="wanted")
    all_reduce(torch.zeros(1), prof=True)
    assert log.get_operation_names() == ["wanted", "all_reduce"]
    assert log.get_total_operations() == 2


def test_debug_names_the_caller(restore_comms_logger):
    restore_comms_logger.enabled = restore_comms_logger.debug = True
    caller_of_the_op()
    assert restore_comms_logger.get_operation_names() == [
        "all_reduce | [Caller Func: caller_of_the_op]"]


def test_message_size_of_lists_p2p_ops_and_no_tensor():
    assert message_size({"tensor": torch.zeros(3)}) == 12
    assert message_size({"input_list": [torch.zeros(2), torch.zeros(2)]}) == 16
    assert message_size({"p2p_op_list": [P2POp(isend, torch.zeros(5), 1)]}) == 20
    assert message_size({"group": None}) == 0
