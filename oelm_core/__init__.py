"""OELM Lab: GPT models with random orthogonal, optionally frozen, attention Q/K projections.

The stable public API (notebooks, the app, benchmarks and outside scripts rely on these):

    build_model(preset, variant, seed=0, **overrides) -> GPT   (or build_model(ModelConfig))
    GPT: the model; model(idx) -> logits (B, T, vocab_size), model(idx, targets) -> mean loss
    model_config(preset, variant, **overrides) -> ModelConfig
    ModelConfig, RunConfig: the configuration dataclasses (oelm_core.config)
    ConfigError: raised for a parameter, preset or variant that cannot be used as given
    PRESETS: preset name -> the ModelConfig shape it sets
    VARIANTS: variant name -> one-line description
    count_parameters(model) -> {"trainable", "frozen", "total", "by_component"}
    flops_per_token(cfg, context=None) -> FLOPs per trained token, forward and backward, by component
    memory_account(model) -> bytes of weights, gradients and AdamW state, and what freezing saves
"""

from collections.abc import Iterator, Mapping

from oelm_core import envfile as _envfile

# oelm.env (`python -m oelm_core.offline`) before anything reads the environment: the Hugging
# Face libraries read HF_HUB_OFFLINE once, when they are imported.
_envfile.load()

from oelm_core import config as _config
from oelm_core.accounting import count_parameters, flops_per_token, memory_account
from oelm_core.config import PRESETS, ConfigError, ModelConfig, RunConfig, model_config, variants
from oelm_core.model import GPT, build_model


class _Variants(Mapping):
    """A read-only view of the variant registry (``config.variants()``), read on every access, so
    that variants registered after import (``config.register_variant``) appear wherever the app,
    notebooks and analysis list them."""

    def __getitem__(self, name: str) -> str:
        return _config._VARIANT_SPECS[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(_config._VARIANT_SPECS)

    def __len__(self) -> int:
        return len(_config._VARIANT_SPECS)

    def __repr__(self) -> str:
        return repr(variants())


VARIANTS = _Variants()

__all__ = [
    "GPT",
    "PRESETS",
    "VARIANTS",
    "ConfigError",
    "ModelConfig",
    "RunConfig",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "memory_account",
    "model_config",
]
