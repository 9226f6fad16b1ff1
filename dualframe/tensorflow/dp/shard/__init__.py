"""Sharded data parallelism in TensorFlow/Keras 3 (ZeRO-1/2/3): the optimizer, its state and the parameters' slices."""
