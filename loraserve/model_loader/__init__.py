"""Model resolution and loading: locate the files, parse the config, pick the class, stream the weights."""

from __future__ import annotations

from loraserve.model_loader.config import create_model_config, load_hf_config
from loraserve.model_loader.loader import get_model
from loraserve.model_loader.weights import iterate_weights

__all__ = ["create_model_config", "get_model", "iterate_weights", "load_hf_config"]
