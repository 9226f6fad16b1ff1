"""Process pipelines in TensorFlow/Keras 3: ``DistributedPipeline``, each stage's work, the links between stages."""
