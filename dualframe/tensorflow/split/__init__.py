"""A TensorFlow/Keras 3 model split in one process: ``ModelParallel``, ``Pipeline``, balance, tied weights."""
