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

import artifact
from artifact.errors import ArtifactError, QuicksilverError
from ..paged.kv import PagedBatch
from .forward import LlamaForward, StepMeta
from .weights import load_weights

log = logging.getLogger("quicksilver.cuda")
# step sizes (tokens) captured as CUDA graphs: decodes, verifications and prompt chunks up to the largest
GRAPH_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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
                 verify: bool = True, graphs: bool = True, max_graph_tokens: int = 512,
                 max_model_len: int | None = None, kernels=None):
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
        self.max_graph_tokens = min(max_graph_tokens, self.graph_max_seq_len)
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
        rows = np.asarray(logits_indices, np.int64)
        with torch.inference_mode():
            if self.graphs_enabled and self._graph_fits(len(input_ids), batch):
                out = self._replay(input_ids, batch, rows)
            else:
                ids, meta, rows_t = self._upload(input_ids, batch, rows, batch.max_seq_len)
                out = self.model(ids, meta, rows_t, self.caches)
            return out.cpu().numpy()           # the step's one synchronization

    def _to_device(self, flat: np.ndarray) -> torch.Tensor:
        """One int32 host array to the device in one copy (through a pinned buffer on the GPU)."""
        if self.device.type != "cuda":
            return torch.from_numpy(flat)
        return self._pinned_host(flat).to(self.device, non_blocking=True)

    def _pinned_host(self, flat: np.ndarray) -> torch.Tensor:
        """`flat` in the runner's pinned buffer (grown as needed), which a non-blocking copy can read from; the step's
        synchronization comes before the next step writes it again."""
        if self._pinned.numel() < flat.size:
            self._pinned = torch.empty(2 * flat.size, dtype=torch.int32, pin_memory=True)
        host = self._pinned[:flat.size]
        host.numpy()[:] = flat
        return host

    def _upload(self, input_ids: np.ndarray, batch: PagedBatch, rows: np.ndarray, max_seq_len: int):
        """Every per-step array in one int32 host buffer, one copy to the device, views into it."""
        parts = [np.asarray(input_ids, np.int32), batch.positions, batch.slot_mapping.astype(np.int32),
                 batch.cu_seqlens_q, batch.past_lens, rows.astype(np.int32), batch.block_tables.reshape(-1)]
        ids, positions, slots, cu, past, rows_t, table = _split(self._to_device(np.concatenate(parts)), parts)
        meta = StepMeta(positions, slots, cu, past, table.view(batch.block_tables.shape), max_seq_len, batch)
        return ids.long(), meta, rows_t.long()

    # -- CUDA graphs ------------------------------------------------------------------------------
    def _graph_fits(self, num_tokens: int, batch: PagedBatch) -> bool:
        return num_tokens <= self.max_graph_tokens and batch.max_seq_len <= self.graph_max_seq_len

    def _bucket(self, n: int) -> int:
        return next(b for b in GRAPH_TOKENS if b >= n)

    def _replay(self, input_ids: np.ndarray, batch: PagedBatch, rows: np.ndarray) -> torch.Tensor:
        """One pinned host array copied straight into the graph's inputs (the rows asked for ride at its end),
        the replay, the rows' logits gathered on the device."""
        size = self._bucket(len(input_ids))
        graph, static_in, static_out, _ = self._graphs.get(size) or self._capture(size)
        flat = graph_inputs(input_ids, batch, size, self.max_blocks_per_seq, rows)
        static_in.copy_(self._pinned_host(flat), non_blocking=True)
        graph.replay()
        return static_out.index_select(0, static_in[flat.size - size:flat.size - size + len(rows)].long())

    def _capture(self, size: int):
        """Capture a step of up to `size` tokens in up to `size` sequences (graph_inputs pads any smaller step to
        it) whose KV may reach the served context: the kernels' grid is sized for that bound, and partitions past
        a sequence's length do nothing. Logits come out for every token slot; the replay picks the rows asked."""
        mb = self.max_blocks_per_seq
        static_in = torch.zeros(graph_inputs_size(size, mb), dtype=torch.int32, device=self.device)
        ids, positions, slots, cu, past, tables = _graph_views(static_in, size, mb)
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
        log.debug("captured a %d-token step graph in %.0f ms", size, 1e3 * (time.perf_counter() - t0))
        # everything the graph reads or writes stays referenced: a freed input's memory would be reused by the
        # next eager step while the graph keeps reading it
        self._graphs[size] = entry = (graph, static_in, out, (meta, rows))
        return entry

    def capture_graphs(self) -> float:
        """Capture every step bucket now (warm-up); returns the seconds it took."""
        if not self.graphs_enabled:
            return 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for size in GRAPH_TOKENS:
                if size <= self.max_graph_tokens and size not in self._graphs:
                    self._capture(size)
        return time.perf_counter() - t0


def graph_inputs_size(tokens: int, max_blocks: int) -> int:
    return 4 * tokens + 1 + tokens + tokens * max_blocks + tokens


def graph_inputs(input_ids: np.ndarray, batch: PagedBatch, tokens: int, max_blocks: int,
                 rows: np.ndarray | None = None) -> np.ndarray:
    """A step of n ≤ `tokens` tokens in s sequences as a graph of `tokens` token and sequence slots reads it (one
    int32 array: ids, positions, slots, cu_seqlens_q, past_lens, block tables; then the logits rows asked for,
    which the graph does not read). Padding tokens form one dummy sequence after the real ones (past 0, block 0,
    slot -1: its K/V are never written, its rows never read); the sequence slots after it are empty (no query
    rows: they cost nothing)."""
    n, s = len(input_ids), len(batch.past_lens)
    flat = np.zeros(graph_inputs_size(tokens, max_blocks), np.int32)
    ids, positions, slots, cu, past, tables = _graph_views(flat, tokens, max_blocks)
    if rows is not None:
        flat[len(flat) - tokens:len(flat) - tokens + len(rows)] = rows
    ids[:n], positions[:n], slots[:n] = input_ids, batch.positions, batch.slot_mapping
    slots[n:] = -1
    positions[n:] = np.arange(tokens - n)
    cu[:s + 1], cu[s + 1:] = batch.cu_seqlens_q, tokens
    past[:s] = batch.past_lens
    tables[:s, :batch.block_tables.shape[1]] = batch.block_tables
    return flat


def _graph_views(flat, tokens: int, max_blocks: int):
    """ids, positions, slots [tokens]; cu_seqlens_q [tokens + 1]; past_lens [tokens]; tables [tokens, max_blocks]."""
    sizes = [tokens, tokens, tokens, tokens + 1, tokens, tokens * max_blocks]
    *head, tables = _split(flat, sizes)
    return (*head, tables.reshape(tokens, max_blocks) if isinstance(tables, np.ndarray) else tables.view(tokens, max_blocks))


def _split(flat, parts):
    """Consecutive views of `flat`, one per part (an array, or a length)."""
    views, at = [], 0
    for p in parts:
        size = p if isinstance(p, int) else p.size
        views.append(flat[at:at + size])
        at += size
    return views
