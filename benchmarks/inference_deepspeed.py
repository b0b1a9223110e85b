"""The DeepSpeed peers of ``benchmarks/inference.py``: one rank of DeepSpeed 0.19.8's
``init_inference``, run in DeepSpeed's venv under torch.distributed.run.

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python -m torch.distributed.run --nproc_per_node T \\
        benchmarks/inference_deepspeed.py --variant autotp ...   (inference.py passes the rest)

Each rank loads the whole model with ``from_pretrained`` (DeepSpeed's documented way: AutoTP
shards a model that is already in memory), then ``deepspeed.init_inference`` with
``tensor_parallel={"tp_size": T}`` and the dtype, and ``VARIANTS[--variant]`` on top:

    autotp   nothing more: AutoTP, DeepSpeed's default without kernel injection
    inject   replace_with_kernel_inject=True: its fused inference kernels
    policy   injection_policy={<decoder block>: <its output projections>} (the arch's
             ``block`` and ``row_parallel``, e.g. GPT2Block: ("attn.c_proj", "mlp.c_proj")):
             the manual policy (the layers whose outputs are all-reduced) DeepSpeed documents
             for models AutoTP does not parse

An exception from ``init_inference`` is the row's ``not runnable: <it>``: DeepSpeed 0.19.8 on
CPU refuses int8 ("Data type torch.int8 is not supported by cpu accelerator") and GPT-2 at
tp 2 (AutoTP: "AutoTP not supported for model. Please use kernel injection since container
policy for model exists."; kernel injection: its ops have no CPU build; the manual policy:
its Conv1D partitioning splits GPT-2's non-square c_attn by the wrong dimension). Its AutoTP
does take LLaMA at tp 2.

Measuring and scoring are ``inference_worker.py``'s (``measure``), the same code as for the
other peers; the import baseline is taken after deepspeed is imported. Two DeepSpeed
specifics: after ``init_distributed`` its shared-memory all-reduce is switched off
(``shm_vector_kernel_level = 0``; it segfaults here otherwise), and the script ends with
``os._exit`` (DeepSpeed's interpreter shutdown can hang or crash after the work).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_worker import (  # torch-free at import
    ARCHS,
    block_class,
    import_baseline,
    layer_types,
    load_reference,
    measure,
    one_line,
    run_worker,
    worker_arguments,
)


def _policy(arch: str) -> dict:
    return {"injection_policy": {block_class(arch): ARCHS[arch].row_parallel}}


VARIANTS = {"autotp": lambda arch: {},
            "inject": lambda arch: {"replace_with_kernel_inject": True},
            "policy": _policy}
"""--variant -> the extra keyword arguments of init_inference for an arch (built in the
rank)."""


def worker(args: argparse.Namespace) -> tuple[int, dict]:
    import deepspeed

    setup, reference = load_reference(args)
    import_rss = import_baseline(setup.arch)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed()
    deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0  # its shm all-reduce segfaults here
    rank = dist.get_rank()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    try:
        engine = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": args.tp},
            dtype=torch.int8 if args.dtype == "int8" else torch.float32,
            **VARIANTS[args.variant](setup.arch))
    except Exception as exc:
        print(f"init_inference raised {one_line(exc)}", file=sys.stderr)
        return rank, {"status": f"not runnable: {one_line(exc)}"}
    load_s = time.perf_counter() - start
    layers = layer_types(engine.module, ARCHS[setup.arch].layers)
    print(f"rank {rank}: after init_inference: {layers}", file=sys.stderr, flush=True)

    def generate(ids, n, **kw):
        return engine.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.inference_mode():
        result = measure(generate, lambda ids: engine(input_ids=ids).logits, setup, reference,
                         barrier=dist.barrier)
    return rank, {"status": "ok", "load_s": load_s, "threads": torch.get_num_threads(),
                  "world": dist.get_world_size(), "layers": layers,
                  "import_rss_kib": import_rss,
                  "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                  "transformers": __import__("transformers").__version__, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="autotp")
    worker_arguments(parser)
    args = parser.parse_args()
    run_worker(args, lambda: worker(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
