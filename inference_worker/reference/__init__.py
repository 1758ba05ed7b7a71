"""Test references, not product code: the contiguous-KV runner and engine that the paged engine is compared with.

Nothing in the worker imports this package; tests and benches do.
"""
