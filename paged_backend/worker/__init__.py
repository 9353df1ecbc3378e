"""The model on a device: loading, the KV cache, step inputs, CUDA graphs, tensor parallelism."""
