"""Data parallelism, framework-neutral: gradient compression, argument checks, learning-rate scaling."""
