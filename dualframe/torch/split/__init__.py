"""A torch model split in one process: ``ModelParallel``, ``Pipeline``, balance, tied weights."""
