"""The engine core: requests, the paged-KV block accounting and the token-budget scheduler.

Runs in the engine-core process. Plain Python: importing it never imports torch.
"""
