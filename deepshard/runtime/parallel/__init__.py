"""3D parallelism: the (pipe, data, tensor) topology, tensor-parallel layers and AutoTP,
pipeline modules and schedules."""
