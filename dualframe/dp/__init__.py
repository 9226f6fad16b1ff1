"""Data parallelism, framework-neutral: gradient compression, argument checks, learning-rate scaling, sharding plans.

``shard`` cuts parameters into per-rank slices for ZeRO-1/2; ``zero3`` adds ZeRO-3's plan for both adapters:
which modules are blocks gathered as one (``block_paths``), which rank owns which slice of each block
(``ParameterShardPlan``), the gather/prefetch order (``GatherOrder``), the refusal of shared parameters
(``check_unshared``) and the unsharded checkpoint layout.
"""
