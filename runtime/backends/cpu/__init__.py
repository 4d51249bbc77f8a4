"""The CPU backend: ONNX Runtime's (or our qs) attention over contiguous KV slots whose memory follows the tokens
(kv.py, slots.py), the model runner (runner.py) and the draft model that speculates for it (draft.py)."""

from .backend import CpuBackend

__all__ = ["CpuBackend"]
