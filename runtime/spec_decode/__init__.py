"""Speculative decoding: proposers (draft model, n-gram), exact verification, adaptive speculation length."""
