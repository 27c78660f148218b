"""Workers: models, KV cache tensors, attention, sampling. The only package that touches tensors.

Importing the package itself is cheap (no torch): its modules are imported where they are used.
"""
