"""PagedModelRunner: one ONNX Runtime session over a `--target cuda` engine (packed tokens, paged KV).

The KV cache is one pair of [num_blocks, block_size, kv_heads, head_dim] fp16 tensors per layer, allocated
once on the execution provider's device and bound as both the cache inputs and the aliased cache outputs,
so PagedAttention updates it in place. Each step takes a PagedBatch (block tables, packed offsets, slot
mapping — built by the backend's kv.py on the host) and returns logits for the requested rows.

The backend is chosen from the engine's target and what is installed: CUDAExecutionProvider from
onnxruntime-gpu. Without it the runner refuses with what to install or rebuild.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

import artifact
from artifact.errors import ArtifactError, QuicksilverError

from .kv import PagedBatch
from ..onnx_session import open_session


class BackendUnavailable(QuicksilverError):
    """The engine's target needs an execution provider (or hardware) this machine lacks."""


def select_providers(target: str) -> list[str]:
    """The execution providers that run a `target` engine here, best first; raises BackendUnavailable."""
    available = ort.get_available_providers()
    if target == "cpu":
        return ["CPUExecutionProvider"]
    if target == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise BackendUnavailable(
                "this engine was built with --target cuda (fp16, com.microsoft.PagedAttention) and needs ONNX "
                "Runtime's CUDAExecutionProvider: install onnxruntime-gpu on a machine with an NVIDIA GPU "
                f"(this onnxruntime offers {', '.join(available)}), or rebuild the engine with --target cpu")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if target == "tensorrt":
        raise BackendUnavailable(
            "this engine was built with --target tensorrt (standard ops + the QsPagedAttention TensorRT plugin); "
            "Quicksilver's runtime does not drive TensorRT plans yet: serve a --target cuda engine with "
            "onnxruntime-gpu, or a --target cpu engine")
    raise BackendUnavailable(f"unknown engine target {target!r}; rebuild the engine with this compiler")


class PagedModelRunner:
    def __init__(self, engine_dir: str | Path, num_blocks: int, block_size: int = 16, *,
                 providers: list[str] | None = None, custom_ops_library: str | None = None, verify: bool = True):
        """providers: override the choice made from the engine's target (tests run the graph on CPU with a
        reference PagedAttention from `custom_ops_library`)."""
        self.engine_dir = Path(engine_dir)
        self.manifest = artifact.load(self.engine_dir, verify=verify)
        target = self.manifest.get("target")
        if target not in ("cuda", "tensorrt"):
            raise ArtifactError(f"{engine_dir} targets {target!r}; PagedModelRunner runs --target cuda engines")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        providers = providers or select_providers(target)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if custom_ops_library:
            so.register_custom_ops_library(custom_ops_library)
        self.session = open_session(self.engine_dir, self.manifest, so, providers)
        m = self.manifest["model"]
        self.num_layers, self.vocab_size, self.max_seq_len = m["num_layers"], m["vocab_size"], m["max_seq_len"]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self._metadata = any(i.name == "attention_metadata" for i in self.session.get_inputs())
        shape = [num_blocks, block_size, m["num_kv_heads"], m["head_dim"]]
        self.key_cache = [self._zeros(shape) for _ in range(self.num_layers)]
        self.value_cache = [self._zeros(shape) for _ in range(self.num_layers)]
        # The caches never move: bound once, as inputs and as the aliased outputs; steps rebind the rest.
        self._io = self.session.io_binding()
        for i in range(self.num_layers):
            for kind, caches in (("key", self.key_cache), ("value", self.value_cache)):
                self._io.bind_ortvalue_input(f"{kind}_cache.{i}", caches[i])
                self._io.bind_ortvalue_output(f"{kind}_cache_out.{i}", caches[i])
        self._logits = np.empty((0, self.vocab_size), np.float32)

    def _zeros(self, shape: list[int]) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float16), self.device, 0)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def step(self, input_ids: np.ndarray, batch: PagedBatch, logits_indices: np.ndarray) -> np.ndarray:
        """Run the packed tokens `input_ids` [num_tokens] of `batch`; return logits [len(logits_indices), vocab]
        (a view of the runner's buffer, valid until its next step)."""
        if input_ids.shape != batch.slot_mapping.shape:
            raise ValueError(f"{input_ids.shape[0]} tokens for a batch of {batch.slot_mapping.shape[0]}")
        if batch.max_seq_len > self.max_seq_len:
            raise ValueError(f"a sequence reaches {batch.max_seq_len} tokens; the engine serves {self.max_seq_len}")
        n = len(logits_indices)
        if self._logits.shape[0] < n:
            self._logits = np.empty((max(n, 2 * self._logits.shape[0]), self.vocab_size), np.float32)
        io = self._io
        io.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        io.bind_cpu_input("cumulative_sequence_length", batch.cu_seqlens_q)
        io.bind_cpu_input("past_seqlens", batch.past_lens)
        io.bind_cpu_input("block_table", batch.block_tables)
        io.bind_cpu_input("slot_mapping", batch.slot_mapping.astype(np.int32))
        if self._metadata:
            io.bind_cpu_input("attention_metadata", np.array([batch.max_query_len, batch.max_seq_len], np.int32))
        io.bind_cpu_input("logits_indices", np.ascontiguousarray(logits_indices, np.int64))
        io.bind_output("logits", "cpu", 0, np.float32, [n, self.vocab_size], self._logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return self._logits[:n]
