"""Reliability in torch: failures and stalls, checkpoints, stage checkpoints, elastic runs."""
