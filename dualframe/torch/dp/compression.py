"""Horovod's ``Compression`` namespace for torch, built from the core's shared compressors."""
from dualframe.dp.compression import CompressionSet
from dualframe.torch.collectives import TorchCaster

#: ``Compression.none`` and ``Compression.fp16``, as in ``horovod.torch.Compression``.
Compression = CompressionSet(TorchCaster())
