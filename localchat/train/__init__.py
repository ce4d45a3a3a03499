"""Retaining-head training: offline data, label extraction, the training loop."""
