"""The offline demo chat model: a tiny Qwen2 trained on a synthetic dialogue corpus.

Real deployments set MODEL=/path/to/a/Hugging Face checkpoint; this exists so the platform runs
and learns offline with no download.
"""
from .build import build_demo_model, is_built
from .config import DemoModelConfig

__all__ = ["DemoModelConfig", "build_demo_model", "is_built"]
