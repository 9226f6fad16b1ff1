"""Sharded data parallelism in torch (ZeRO-1/2/3): the optimizer, its state and the parameters' slices."""
