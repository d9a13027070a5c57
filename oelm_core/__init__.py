"""OELM Lab: GPT models with random orthogonal, optionally frozen, attention Q/K projections.

The stable public API (notebooks, the app, benchmarks and outside scripts rely on these):

    build_model(preset, variant, **overrides) -> GPT
    count_parameters(model) -> {"trainable", "frozen", "total", "by_component"}
    VARIANTS: variant name -> one-line description
"""

from oelm_core.accounting import count_parameters, flops_per_token, memory_account
from oelm_core.config import PRESETS, ConfigError, ModelConfig, RunConfig, model_config, variants
from oelm_core.model import GPT, build_model

VARIANTS = variants()

__all__ = ["GPT", "PRESETS", "VARIANTS", "ConfigError", "ModelConfig", "RunConfig", "build_model",
           "count_parameters", "flops_per_token", "memory_account", "model_config"]
