"""Data parallelism in TensorFlow/Keras 3: the optimizer wrapper, compression, synchronized batch norm, sharding."""
