"""Evaluation: validation loss, text generation, HellaSwag, and loading checkpoints for them."""
