"""Workers: models, KV cache tensors, attention, sampling. The only package that touches tensors."""

from worker.model_maker import ensure_default_model

__all__ = ["ensure_default_model"]
