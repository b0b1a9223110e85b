"""Train a tiny GPT through the engine with the ``data_efficiency`` section; started by
ds-run. Reports ``DE <json>`` per rank: each step's loss (the mean over the data-parallel
ranks), sequence length fed, learning rate and the ids of this rank's samples.

    data_efficiency_train.py <config.json> <steps> [--save DIR:STEP] [--load DIR]
                             [--dynamic MAX_TOKENS]

The dataset: 512 windows of the standard library's source, ``SEQ`` + 1 bytes each at
seeded starts, each sample ``(inputs, targets, id)`` (so the test can rebuild the
batches). ``--save DIR:STEP`` saves a checkpoint after that step; ``--load DIR``
resumes from the newest one first. ``--dynamic`` trains on variable-length samples
(sample ``i`` cut to ``length(i)`` tokens, right-padded to the micro-batch's longest with
targets -100) with DeepSpeed's
``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`` under a budget of
MAX_TOKENS tokens per micro-batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from gpt import GPT, GPTConfig, stdlib_corpus

import deepshard

SEQ = 32
TINY = GPTConfig(vocab_size=256, seq_len=SEQ, n_layer=4, n_head=2, d_model=32)


class Windows(torch.utils.data.Dataset):
    """Window ``i``: inputs, targets and ``i``; ``length(i)`` for dynamic runs."""

    def __init__(self, count: int = 512):
        corpus = stdlib_corpus(1 << 20)
        starts = np.random.default_rng(0).integers(0, len(corpus) - SEQ - 1, size=count)
        self.windows = torch.from_numpy(
            np.stack([corpus[s:s + SEQ + 1] for s in starts]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        w = self.windows[i]
        return w[:-1], w[1:], i

    @staticmethod
    def length(i: int) -> int:
        return 4 + (i * 7) % (SEQ - 3)


def padded(samples):
    """A dynamic run's micro-batch: each sample cut to its own length, right-padded to the
    longest (targets -100 on the padding)."""
    longest = max(Windows.length(i) for _, _, i in samples)
    out = []
    for x, y, i in samples:
        own = Windows.length(i)
        out.append((torch.cat([x[:own], torch.zeros(longest - own, dtype=x.dtype)]),
                    torch.cat([y[:own], torch.full((longest - own,), -100, dtype=y.dtype)]),
                    i))
    return collate(out)


def collate(samples):
    xs, ys, ids = zip(*samples, strict=True)
    return torch.stack(xs), torch.stack(ys), torch.tensor(ids)


def main() -> None:
    args = sys.argv[1:]
    args = args[1:] if args and args[0].startswith("--local_rank") else args
    config, steps = json.loads(Path(args[0]).read_text()), int(args[1])
    opts = dict(zip(args[2::2], args[3::2], strict=True))
    deepshard.init_distributed()
    torch.manual_seed(0)
    model = GPT(TINY)
    data = Windows()
    dynamic = opts.get("--dynamic")
    engine, _, loader, _ = deepshard.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        training_data=None if dynamic else data)
    if dynamic:
        from deepshard.data_efficiency.dynamic_batching import (
            get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed as build,
        )
        seqlens = [Windows.length(i) for i in range(len(data))]
        loader, _, _ = build(data, engine, dataset_seqlens=seqlens,
                             dataloader_collate_fn=padded)
    if "--load" in opts:
        engine.load_checkpoint(opts["--load"])
    save_dir, _, save_at = opts.get("--save", "").partition(":")
    report = {"rank": dist.get_rank(), "losses": [], "seqs": [], "lrs": [], "ids": []}
    batches = iter(loader)
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y, ids = next(batches)
            report["ids"].append(ids.tolist())
            report["seqs"].append(int(x.shape[1]))
            loss = engine(x, y)
            engine.backward(loss)
            report["lrs"].append(engine.get_lr()[0])
            engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        report["losses"].append(float(mean) / dist.get_world_size())
        if save_at and engine.global_steps == int(save_at):
            engine.save_checkpoint(save_dir)
    print("DE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
