"""Data parallelism in torch: the optimizer wrapper, compression, synchronized batch norm, sharding."""
