"""Backend names and the default rendezvous port, as ``deepspeed.comm.constants`` has them."""

from deepshard.comm.distributed import DEFAULT_PORT as TORCH_DISTRIBUTED_DEFAULT_PORT

NCCL_BACKEND = "nccl"
GLOO_BACKEND = "gloo"
MPI_BACKEND = "mpi"
CCL_BACKEND = "ccl"
HCCL_BACKEND = "hccl"

__all__ = ["CCL_BACKEND", "GLOO_BACKEND", "HCCL_BACKEND", "MPI_BACKEND", "NCCL_BACKEND",
           "TORCH_DISTRIBUTED_DEFAULT_PORT"]
