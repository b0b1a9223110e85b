"""Which checkpoint ``Trainer.train(resume_from_checkpoint=...)`` resumes, universal
checkpoints included.

transformers' Trainer resumes a ``checkpoint-N/`` folder: its own files
(``trainer_state.json``, ``scheduler.pt``, ``rng_state_*.pth``) plus the engine's
checkpoint, which ``engine.load_checkpoint(folder)`` finds through ``latest`` (or, with the
config's ``checkpoint.load_universal``, ``latest_universal``). Two more ways a user points
at a checkpoint are taken, where DeepSpeed's Trainer path fails: the tag directory itself
(``checkpoint-N/global_stepN_universal``, or ``global_stepN``; here: the Trainer's state is
its folder's, the engine loads that tag), and a ``checkpoint-N/`` whose only engine
checkpoint is a universal one while the config does not set ``load_universal`` (the
engine's load finds it: there is nothing else to resume).
"""

from __future__ import annotations

import logging
from pathlib import Path

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, universal
from deepshard.runtime.checkpoint import format as fmt

logger = logging.getLogger("deepshard")

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' trainer_utils name


def checkpoint_folder(path: str) -> tuple[str, str | None]:
    """The ``checkpoint-N`` folder whose Trainer state resumes, and the engine tag to load
    from it (``None``: the one the folder's pointers name), for ``resume_from_checkpoint=
    path``: a checkpoint folder, or a tag directory inside one.

    Raises:
        UsageError: ``path`` is neither.
    """
    given = Path(path)
    if (given / TRAINER_STATE_NAME).is_file():
        return path, None
    if given.is_dir() and (given.parent / TRAINER_STATE_NAME).is_file() and \
            _is_tag(given):
        logger.info("resuming the Trainer state of %s and the engine checkpoint %s",
                    given.parent, given.name)
        return str(given.parent), given.name
    raise UsageError(f"not a Trainer checkpoint folder (no {TRAINER_STATE_NAME})",
                     where=f"resume_from_checkpoint={path}",
                     hint="pass the checkpoint-N folder the Trainer saved (it holds "
                          "trainer_state.json and global_stepN/), or a global_stepN or "
                          "universal tag directory inside it")


def _is_tag(path: Path) -> bool:
    """A universal tag directory, or one of DeepSpeed's or deepshard's."""
    return universal.is_universal_tag(path) or ds_files.is_deepspeed_tag(path) or \
        fmt.read_manifest(path) is not None
