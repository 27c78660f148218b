"""Workers: models, KV cache tensors, attention, sampling. The only package that touches tensors."""
