"""Reliability in TensorFlow/Keras 3: failures and stalls, checkpoints, stage checkpoints, elastic runs."""
