"""Horovod's ``Compression`` namespace for TensorFlow, built from the core's shared compressors."""
from dualframe.dp.compression import CompressionSet
from dualframe.tensorflow.collectives import TFCaster

#: ``Compression.none`` and ``Compression.fp16``, as in ``horovod.tensorflow.Compression``.
Compression = CompressionSet(TFCaster())
