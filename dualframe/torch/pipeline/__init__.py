"""Process pipelines in torch: ``DistributedPipeline``, each stage's work, the links between stages."""
