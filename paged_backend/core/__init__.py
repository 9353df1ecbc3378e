"""Requests, KV blocks, prefix-cache hashing and the scheduler: pure Python, no torch."""
