"""Command-line tools that inspect configs and models without training."""
