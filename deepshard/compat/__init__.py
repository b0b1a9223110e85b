"""Everything DeepSpeed-shaped: ``import deepspeed`` resolving to deepshard.

``ds-run --deepspeed_compat`` puts :data:`deepshard.contract.SHIM_DIR` (this package's
``shim/``) first on the workers' ``PYTHONPATH``. That directory holds one package,
``deepspeed``, whose import runs :func:`.alias.install`: ``deepspeed`` becomes deepshard
itself and every ``deepspeed.x.y`` resolves through the one path table :mod:`.paths` to where
deepshard defines it; what deepshard lacks fails with one line naming the closest feature
(:mod:`.missing`). This is the top layer: it may import anything of deepshard, and nothing of
deepshard imports it. Nothing here imports torch until a DeepSpeed name is used.
"""
