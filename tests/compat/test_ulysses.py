"""``scripts/ulysses_attention.py`` (DeepSpeed-Ulysses as users write it for their own
model: ``DistributedAttention`` over a torch.distributed group, ALST's
``UlyssesSPDataLoaderAdapter`` from ``deepspeed.runtime.sequence_parallel.ulysses_sp``) on
2 ranks with sequence parallelism 2, against one process of plain torch on the whole
sequences.

The adapter gathers both ranks' batches and yields them one after the other, each rank
holding half of every sequence: step ``2i`` is rank 0's ``i``-th batch, step ``2i + 1``
rank 1's (a ``DistributedSampler`` without shuffling gives rank ``r`` the samples ``r, r +
2, ...``). The script's loss is the mean over the group's valid tokens (the last position
has no next token); the engine averages the gradients over both ranks, which together
hold one sequence, so the reference is AdamW on the full-sequence mean loss of each batch,
clipped at 1.0.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.compat.common import TOL, loss_diff, max_diff, run_compat
from tests.compat.scripts.ulysses_model import VOCAB, TinyAttentionLM, TokenDataset

WORLD, SAMPLES, MICRO, SEED = 2, 8, 2, 1234  # the script's defaults


def reference():
    """Plain torch, one process: per-step losses and final weights."""
    data = TokenDataset(SAMPLES)
    torch.manual_seed(SEED)
    model = TinyAttentionLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.01)
    per_rank = [list(range(r, SAMPLES, WORLD)) for r in range(WORLD)]
    losses = []
    for i in range(SAMPLES // WORLD // MICRO):
        for rank in range(WORLD):
            batch = [data[j] for j in per_rank[rank][i * MICRO:(i + 1) * MICRO]]
            ids = torch.stack([b["input_ids"] for b in batch])
            positions = torch.stack([b["position_ids"] for b in batch])
            labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
            logits = model(ids, positions)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                   ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("stage", [2])
def test_ulysses_script_with_sp_2_matches_plain_torch_on_whole_sequences(stage, tmp_path):
    ranks = run_compat("ulysses_attention.py", tmp_path, "--sp_size", "2", "--stage",
                       str(stage))
    want_losses, want_state = reference()
    for rank, saved in enumerate(ranks):
        assert len(saved["losses"]) == len(want_losses) == 4
        assert loss_diff(saved["losses"], want_losses) < TOL, (rank, saved["losses"],
                                                               want_losses)
        diff, where = max_diff(saved["state"], want_state)
        assert diff < TOL, (rank, where, diff)
