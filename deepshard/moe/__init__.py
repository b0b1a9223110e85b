"""``deepspeed.moe``: Mixture of Experts with expert parallelism.

``layer.MoE`` (DeepSpeed's layer), ``sharded_moe`` (gate, gating functions, the layer that
exchanges tokens), ``experts.Experts``, ``groups`` (expert-parallel process groups,
:func:`~deepshard.moe.groups.configure`), ``utils`` (expert parameters and their optimizer
groups). Importing this package does not import the layer modules."""
