"""What runs a step on a device: model runner, CUDA graphs, sampler, penalties, KV pool sizing."""
