"""Model layer: checkpoint config, loader, and the hybrid Mamba2/attention models."""

from hybridserve.models.config import ConfigError, ModelConfig
from hybridserve.models.loader import CheckpointError, load_model

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "load_model"]
