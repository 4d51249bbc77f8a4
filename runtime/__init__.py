"""Quicksilver runtime: loads engine artifacts and generates tokens (no PyTorch)."""

__version__ = "0.1.0"
