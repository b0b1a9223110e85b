"""``scripts/gan.py`` (training/gan/gan_deepspeed_train.py's pattern) at ZeRO 0 and 2 against
gan_baseline_train.py-style plain torch on the whole global batch.

What the pattern exercises: two engines in one process, client ``torch.optim.Adam``
optimizers, the raw modules called (``netD(real)``, ``netG(noise)``) rather than the
engines, ``netD.zero_grad()`` on the raw module, two ``model_engineD.backward`` calls
before one ``model_engineD.step()``, and the generator's loss taken through the raw
discriminator — its backward also leaves gradients on the discriminator, which the next
``netD.zero_grad()`` must discard as in plain torch. Each engine clips its own gradients'
global norm at 1.0 (the default when the config leaves ``gradient_clipping`` out). Each
rank draws its real samples from a ``DistributedSampler`` and its noise from its own
generator; the reference replays both ranks' samples and noise side by side.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from tests.compat.common import DEFAULT_CLIP, SCRIPTS, TOL, loss_diff, max_diff, run_compat
from tests.compat.scripts.tiny_models import Discriminator, Generator, synthetic_real_samples

WORLD, BATCH = 2, 8  # gan_config.json's train_batch_size
SAMPLES, NZ, LR, BETA1, SEED = 32, 4, 0.0002, 0.5, 999  # the script's defaults


def reference():
    """Plain torch, one process: per-step (errD, errG) and both networks' final weights."""
    torch.manual_seed(SEED)
    netG, netD = Generator(nz=NZ), Discriminator()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=LR, betas=(BETA1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=LR, betas=(BETA1, 0.999))
    criterion = nn.BCELoss()
    (data,) = synthetic_real_samples(SAMPLES).tensors
    micro = BATCH // WORLD
    orders = [list(DistributedSampler(data, num_replicas=WORLD, rank=r)) for r in range(WORLD)]
    noise_gens = [torch.Generator().manual_seed(SEED + 1 + r) for r in range(WORLD)]
    losses = []
    for step in range(len(orders[0]) // micro):
        real = data[[i for order in orders for i in order[step * micro:(step + 1) * micro]]]
        noise = torch.cat([torch.randn(micro, NZ, generator=g) for g in noise_gens])
        netD.zero_grad()
        errD_real = criterion(netD(real), torch.ones(BATCH))
        errD_real.backward()
        fake = netG(noise)
        errD_fake = criterion(netD(fake.detach()), torch.zeros(BATCH))
        errD_fake.backward()
        torch.nn.utils.clip_grad_norm_(netD.parameters(), DEFAULT_CLIP)
        optimizerD.step()

        netG.zero_grad()
        errG = criterion(netD(fake), torch.ones(BATCH))
        errG.backward()
        torch.nn.utils.clip_grad_norm_(netG.parameters(), DEFAULT_CLIP)
        optimizerG.step()
        losses.append([(errD_real + errD_fake).item(), errG.item()])
    state = {f"{name}.{k}": v for name, net in (("netD", netD), ("netG", netG))
             for k, v in net.state_dict().items()}
    return losses, state


@pytest.mark.parametrize("zero", [0, 2])
def test_gan_pattern_matches_plain_torch(zero, tmp_path):
    args = ["--deepspeed_config", str(SCRIPTS / "gan_config.json")]
    if zero:
        args += ["--zero", str(zero)]
    ranks = run_compat("gan.py", tmp_path, *args)
    want_losses, want_state = reference()
    for rank, saved in enumerate(ranks):
        assert len(saved["losses"]) == SAMPLES // BATCH
        for which, name in enumerate(("errD", "errG")):
            got = [x[which] for x in saved["losses"]]
            want = [x[which] for x in want_losses]
            assert loss_diff(got, want) < TOL, (rank, name, got, want)
        diff, where = max_diff(saved["state"], want_state)
        assert diff < TOL, (rank, where, diff)
