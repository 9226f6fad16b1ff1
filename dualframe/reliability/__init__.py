"""Reliability, framework-neutral: failing and stalled ranks, atomic checkpoints, pipeline stage checkpoints."""
