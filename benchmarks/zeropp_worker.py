"""One rank of ``benchmarks/zeropp.py``: the reference GPT at ZeRO stage 3 under deepshard or
DeepSpeed, with the variant's keys; prints ``RESULT <json>`` (rank 0: step times and loss;
each host's first rank: the bytes its host sent across the network per step).

    python benchmarks/zeropp_worker.py deepshard|deepspeed '<zero_optimization JSON>' STEPS
                                       ['<GPTConfig overrides JSON>']
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, rank_indices, sample_batch, stdlib_corpus

MICRO = 4


def host_tx_bytes() -> int:
    """Bytes this host (network namespace) sent on its link: the traffic crossing hosts."""
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    runtime, zero, steps = args[0], json.loads(args[1]), int(args[2])
    shape = json.loads(args[3]) if len(args) > 3 else {}
    torch.set_num_threads(1)
    if runtime == "deepspeed":
        import deepspeed as lib

        lib.init_distributed(dist_backend="gloo")
        lib.comm.comm.cdb.shm_vector_kernel_level = 0  # its shm all-reduce can segfault
    else:
        import deepshard as lib

        lib.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(**shape)
    model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "train_batch_size": MICRO * world, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, **zero}}
    engine, _, _, _ = lib.initialize(model=model, model_parameters=model.parameters(),
                                     config=config)
    corpus = stdlib_corpus()
    first_local = int(os.environ.get("LOCAL_RANK", "0")) == 0
    times, loss = [], None
    sent = 0
    for step in range(steps + 1):  # step 0 warms up
        x, y = sample_batch(corpus, rank_indices(step, 0, rank, world, MICRO, 1), 0,
                            cfg.seq_len)
        dist.barrier()
        tx, start = host_tx_bytes(), time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
            sent += host_tx_bytes() - tx
    out = {"rank": rank, "times": times, "loss": float(loss)}
    if first_local:
        out["host_tx_per_step"] = sent / steps
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    os._exit(0)  # DeepSpeed's teardown on CPU can hang; nothing is left to write


if __name__ == "__main__":
    main()
