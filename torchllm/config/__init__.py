"""Typed configuration: dataclass sections, TOML loading and CLI overrides."""

from torchllm.config.job_config import ConfigError, JobConfig
from torchllm.config.loader import flat_toml, help_text, load_config, to_toml

__all__ = ["ConfigError", "JobConfig", "flat_toml", "help_text", "load_config", "to_toml"]
