"""The paged backend: block tables over one block pool (kv.py), the `--target cuda` graph's PagedAttention under
ONNX Runtime (runner.py) and a draft under the target's tables (draft.py). The cuda backend reuses its KV
manager, batching and draft with its own runner."""

from .backend import PagedBackend

__all__ = ["PagedBackend"]
