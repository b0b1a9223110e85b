"""``deepspeed.moe``: Mixture of Experts. So far the parameter-group helpers scripts import
at the top whether or not they build an MoE model (DeepSpeedExamples' cifar10 script);
the MoE layer itself is not provided yet."""
