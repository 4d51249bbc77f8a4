"""CudaModelRunner: a `--target cuda` engine executed by our own forward (forward.py) over a paged KV cache.

The same `step(input_ids, PagedBatch, logits_indices)` as the ONNX Runtime paged runner, so the paged KV manager,
the scheduler and the paged draft proposer drive it unchanged. On the GPU, decode-only steps replay CUDA graphs
captured per batch-size bucket at warm-up (a small model's step is hundreds of tiny launches; a replay is one),
with every per-step input in one pinned buffer copied by one transfer; other steps (prompt chunks,
verification) run eagerly. On the CPU (`device="cpu"`) the same forward runs in float32 with the reference ops.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from ... import artifact
from ...errors import ArtifactError, QuicksilverError
from ...kv.paged import PagedBatch
from .forward import LlamaForward, StepMeta
from .weights import load_weights

log = logging.getLogger("quicksilver.cuda")
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DeviceUnavailable(QuicksilverError):
    """--device cuda without a CUDA device (or without the kernels library)."""


def resolve_device(device: str | None) -> torch.device:
    """'cuda', 'cpu', or None (cuda where PyTorch sees a GPU, else cpu)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable("--device cuda: PyTorch sees no CUDA device here; use --device cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {device!r}")
    return torch.device(device)


class CudaModelRunner:
    def __init__(self, engine_dir: str | Path, num_blocks: int, block_size: int = 16, *, device: str | None = None,
                 verify: bool = True, graphs: bool = True, max_graph_batch: int = 32, max_model_len: int | None = None,
                 kernels=None):
        """max_model_len: the longest sequence the engine serves (bounds the decode graphs' attention grid);
        kernels: a runtime.cuda_kernels.CudaKernels (loaded when None and the device is cuda)."""
        self.engine_dir = Path(engine_dir)
        self.manifest = artifact.load(self.engine_dir, verify=verify)
        if self.manifest.get("target") != "cuda":
            raise ArtifactError(f"{engine_dir} targets {self.manifest.get('target')!r}; the cuda backend runs "
                                "--target cuda engines")
        m = self.manifest["model"]
        self.num_layers, self.vocab_size, self.max_seq_len = m["num_layers"], m["vocab_size"], m["max_seq_len"]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = resolve_device(device)
        gpu = self.device.type == "cuda"
        if gpu and kernels is None:
            from ...cuda_kernels import CudaKernels, KernelError

            try:
                kernels = CudaKernels()
            except KernelError as e:
                raise DeviceUnavailable(f"--device cuda needs plugins/cuda: {e}") from None
        self.dtype = torch.float16 if gpu else torch.float32
        self.model = LlamaForward(load_weights(self.engine_dir, self.manifest), m, self.device, self.dtype,
                                  kernels if gpu else None)
        shape = (num_blocks, block_size, m["num_kv_heads"], m["head_dim"])
        self.caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                        torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]
        self.graphs_enabled = gpu and graphs
        self.graph_max_seq_len = min(self.max_seq_len, max_model_len or self.max_seq_len)
        self.max_graph_batch = max_graph_batch
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pinned = torch.empty(0, dtype=torch.int32, pin_memory=gpu)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def backend_name(self) -> str:
        return f"{self.device.type} ({self.model.ops.name}, {'CUDA graphs' if self.graphs_enabled else 'eager'})"

    # -- one step ---------------------------------------------------------------------------------
    def step(self, input_ids: np.ndarray, batch: PagedBatch, logits_indices: np.ndarray) -> np.ndarray:
        """Run the packed tokens `input_ids` [num_tokens] of `batch`; return logits [len(logits_indices), vocab]
        float32 on the host."""
        if input_ids.shape != batch.slot_mapping.shape:
            raise ValueError(f"{input_ids.shape[0]} tokens for a batch of {batch.slot_mapping.shape[0]}")
        if batch.max_seq_len > self.max_seq_len:
            raise ValueError(f"a sequence reaches {batch.max_seq_len} tokens; the engine serves {self.max_seq_len}")
        n, seqs = len(input_ids), len(batch.past_lens)
        decode = n == seqs and len(logits_indices) == n and batch.max_query_len == 1
        with torch.inference_mode():
            if (decode and self.graphs_enabled and n <= self.max_graph_batch
                    and batch.max_seq_len <= self.graph_max_seq_len):
                out = self._replay(input_ids, batch)
            else:
                ids, meta, rows = self._upload(input_ids, batch, np.asarray(logits_indices, np.int64), batch.max_seq_len)
                out = self.model(ids, meta, rows, self.caches)
            return out.cpu().numpy()           # the step's one synchronization

    def _upload(self, input_ids: np.ndarray, batch: PagedBatch, rows: np.ndarray, max_seq_len: int,
                width: int | None = None):
        """Every per-step array in one int32 host buffer, one copy to the device, views into it."""
        tables = batch.block_tables
        if width is not None and tables.shape[1] != width:
            tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
        parts = [np.asarray(input_ids, np.int32), batch.positions, batch.slot_mapping.astype(np.int32),
                 batch.cu_seqlens_q, batch.past_lens, rows.astype(np.int32), tables.reshape(-1)]
        flat = np.concatenate(parts)
        if self.device.type == "cuda":
            if self._pinned.numel() < flat.size:
                self._pinned = torch.empty(2 * flat.size, dtype=torch.int32, pin_memory=True)
            host = self._pinned[:flat.size]
            host.numpy()[:] = flat
            dev = host.to(self.device, non_blocking=True)
        else:
            dev = torch.from_numpy(flat)
        views, at = [], 0
        for p in parts:
            views.append(dev[at:at + p.size])
            at += p.size
        ids, positions, slots, cu, past, rows_t, table = views
        meta = StepMeta(positions, slots, cu, past, table.view(tables.shape), max_seq_len, batch)
        return ids.long(), meta, rows_t.long()

    # -- CUDA graphs for decode -------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return next(b for b in DECODE_BUCKETS if b >= n)

    def _replay(self, input_ids: np.ndarray, batch: PagedBatch) -> torch.Tensor:
        n = len(input_ids)
        size = self._bucket(n)
        entry = self._graphs.get(size) or self._capture(size)
        graph, static_in, static_out, _ = entry
        pad = size - n
        ids = np.concatenate([input_ids, np.zeros(pad, np.int64)]).astype(np.int32)
        positions = np.concatenate([batch.positions, np.zeros(pad, np.int32)])
        slots = np.concatenate([batch.slot_mapping, np.full(pad, -1, np.int64)]).astype(np.int32)
        past = np.concatenate([batch.past_lens, np.zeros(pad, np.int32)])
        tables = np.zeros((size, self.max_blocks_per_seq), np.int32)
        tables[:n, :batch.block_tables.shape[1]] = batch.block_tables
        flat = np.concatenate([ids, positions, slots, past, tables.reshape(-1)])
        host = self._pinned_view(flat)
        static_in.copy_(host, non_blocking=True)
        graph.replay()
        return static_out[:n]

    def _pinned_view(self, flat: np.ndarray) -> torch.Tensor:
        if self._pinned.numel() < flat.size:
            self._pinned = torch.empty(2 * flat.size, dtype=torch.int32, pin_memory=True)
        host = self._pinned[:flat.size]
        host.numpy()[:] = flat
        return host

    def _capture(self, size: int):
        """Capture a decode step of `size` sequences (one token each) whose KV may reach the served context:
        the kernels' grid is sized for that bound, and partitions past a sequence's length do nothing."""
        mb = self.max_blocks_per_seq
        static_in = torch.zeros(4 * size + size * mb, dtype=torch.int32, device=self.device)
        ids, positions, slots, past, tables = (static_in[:size], static_in[size:2 * size], static_in[2 * size:3 * size],
                                               static_in[3 * size:4 * size], static_in[4 * size:].view(size, mb))
        slots.fill_(-1)
        cu = torch.arange(size + 1, dtype=torch.int32, device=self.device)
        rows = torch.arange(size, dtype=torch.long, device=self.device)
        meta = StepMeta(positions, slots, cu, past, tables, self.graph_max_seq_len)
        self.model.ops.workspace(size, size, self.graph_max_seq_len)  # allocated outside the graph
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):                                          # warm cuBLAS' handles and workspaces
                self.model(ids.long(), meta, rows, self.caches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = self.model(ids.long(), meta, rows, self.caches)
        torch.cuda.synchronize()
        log.debug("captured decode graph for %d sequences in %.0f ms", size, 1e3 * (time.perf_counter() - t0))
        # everything the graph reads or writes stays referenced: a freed input's memory would be reused by the
        # next eager step while the graph keeps reading it
        self._graphs[size] = entry = (graph, static_in, out, (meta, cu, rows))
        return entry

    def capture_graphs(self, max_batch: int) -> float:
        """Capture every decode bucket up to `max_batch` now (warm-up); returns the seconds it took."""
        if not self.graphs_enabled:
            return 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for size in DECODE_BUCKETS:
                if size > min(max_batch, self.max_graph_batch) and size != 1:
                    break
                if size not in self._graphs:
                    self._capture(size)
        return time.perf_counter() - t0

