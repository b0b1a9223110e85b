"""``deepspeed.sequence``: long sequences, Ulysses sequence parallelism and ALST.

``layer`` (DeepSpeed's ``DistributedAttention`` and ``_SeqAllToAll``), ``heads`` (which
heads each rank of a sequence-parallel group attends over), ``loader`` (the sequence
shard of a batch, ALST's ``UlyssesSPDataLoaderAdapter``), ``loss`` (the loss averaged
over a group's valid tokens), ``hf`` (ALST's ``UlyssesSPAttentionHF`` for transformers
models), ``tiled`` and ``offload`` (ALST's memory tricks). The groups come from the
config's ``sequence_parallel_size`` (:mod:`deepshard.runtime.parallel.topology`).
Importing this package does not import its modules.
"""
