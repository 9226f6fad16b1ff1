"""Observing runs, framework-neutral: pipeline timelines, Chrome traces, Horovod timelines, charts, benchmark rounds."""
