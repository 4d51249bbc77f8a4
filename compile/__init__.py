"""Quicksilver compile stage: Hugging Face checkpoint → ONNX graph → engine artifact."""

__version__ = "0.1.0"
