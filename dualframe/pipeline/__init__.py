"""Model splits and pipelines, framework-neutral: partitions, micro-batches, schedules, the stage walk, links."""
