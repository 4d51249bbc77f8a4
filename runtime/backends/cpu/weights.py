"""An engine's weights read into one anonymous arena on transparent huge pages, and handed to ONNX Runtime in place.

ONNX Runtime maps each external initializer straight from the engine's data file, onto 4 KiB page-cache pages. A
batch-1 decode step streams every weight once, and on 4 KiB pages the TLB misses and the hardware prefetchers
(which stop at page edges) cost it bandwidth: on an AMD EPYC Zen 4 a 512 MiB two-thread numpy read ran 33.2 GB/s
on huge pages and 29.6 GB/s on 4 KiB ones, and numpy's reading is what tools/bench_decode.py takes as the bound.
The arena is read once at load and registered with SessionOptions.add_initializer, which uses the memory where it
lies: nothing is copied again, and the resident size is what the mapping's would be.

Only tensors that our `qs` ops alone read go there: they compute on the weight in place. ONNX Runtime's own
kernels (MatMul, MatMulNBits, ...) repack their weights at load and never read the original again; from a mapping
it drops those pages, from the arena they would stay resident for nothing (an fp32 engine would take twice its
size). Those tensors, and any a node outside `qs` reads, stay on ONNX Runtime's mapping.

Where the kernel offers no transparent huge pages (THP "never", not Linux), ONNX Runtime keeps its own mapping.
The arena is private memory: processes serving one engine each hold their own copy, where a shared mapping's page
cache was one.
"""

from __future__ import annotations

import math
import mmap
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnxruntime as ort

import artifact
from artifact.errors import ArtifactError

from ... import cpu_ops
from ...kv.memory import HUGE_PAGE, huge_pages_offered

ALIGN = 64                  # each tensor starts on a cache line (ONNX Runtime's own alignment)


class External(NamedTuple):
    """An initializer stored in a data file, as the arena reads it."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    data: Path
    offset: int
    length: int


def _tensors(engine_dir: Path, manifest: dict) -> list[External]:
    """Each external initializer that only `qs` nodes read, checked against the listed data files (element types
    numpy has no dtype for, which an OrtValue cannot be made from here, stay with ONNX Runtime)."""
    import onnx
    from onnx import TensorProto as T

    dtypes = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.DOUBLE: np.float64, T.INT8: np.int8, T.UINT8: np.uint8,
              T.INT16: np.int16, T.UINT16: np.uint16, T.INT32: np.int32, T.UINT32: np.uint32, T.INT64: np.int64,
              T.UINT64: np.uint64, T.BOOL: np.bool_}

    graph = artifact.graph_path(engine_dir, manifest)
    model = onnx.load(str(graph), load_external_data=False)
    readers: dict[str, set[str]] = defaultdict(set)
    for node in model.graph.node:
        for name in node.input:
            readers[name].add(node.domain)
    tensors = []
    for t in model.graph.initializer:
        if t.data_location != T.EXTERNAL or t.data_type not in dtypes or readers[t.name] != {cpu_ops.DOMAIN}:
            continue
        dtype = np.dtype(dtypes[t.data_type])
        info = {e.key: e.value for e in t.external_data}
        shape = tuple(int(d) for d in t.dims)
        if any(d < 0 for d in shape):
            raise ArtifactError(f"{engine_dir}: initializer {t.name} has a negative dimension {list(shape)}; "
                                "rebuild the engine")
        nbytes = math.prod(shape) * dtype.itemsize
        try:
            location, offset, length = info["location"], int(info.get("offset", 0)), int(info.get("length", nbytes))
        except (KeyError, ValueError):
            raise ArtifactError(f"{engine_dir}: initializer {t.name} has no valid external location, offset and "
                                "length; rebuild the engine") from None
        data = artifact.data_path(engine_dir, manifest, graph, location)
        if length != nbytes:
            raise ArtifactError(f"{engine_dir}: initializer {t.name} has {length} bytes in {location}, and its shape "
                                f"{list(shape)} takes {nbytes}; rebuild the engine")
        if offset < 0 or offset + length > data.stat().st_size:
            raise ArtifactError(f"{engine_dir}: initializer {t.name} ({length} bytes at {offset}) lies outside "
                                f"{location}; rebuild the engine")
        tensors.append(External(t.name, dtype, shape, data, offset, length))
    return tensors


class WeightArena:
    """The initializers only our ops read, from the engine's listed data files into one huge-page arena.

    `register(so)` hands them to a session; the arena must outlive that session (the runner keeps it, and ties it
    to the session object too)."""

    def __init__(self, engine_dir: Path, tensors: list[External]):
        starts, end = [], 0
        for t in tensors:
            starts.append(end)
            end += -(-t.length // ALIGN) * ALIGN
        files = {t.data: t.data.stat().st_size for t in tensors}
        if end > sum(files.values()) + ALIGN * len(tensors):      # tensors that alias one range, many times over
            raise ArtifactError(f"{engine_dir}: the graph's tensors claim {end} bytes of {sum(files.values())} in "
                                "its data files; rebuild the engine")
        self.nbytes = end
        size = -(-max(end, 1) // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._map, np.uint8)
        base = -whole.ctypes.data % HUGE_PAGE          # the first huge-page boundary inside the mapping
        self._map.madvise(mmap.MADV_HUGEPAGE, base, size)
        self.address = whole.ctypes.data + base
        self.arrays: dict[str, np.ndarray] = {}
        opened = {}
        try:
            for t, start in zip(tensors, starts):
                if t.data not in opened:
                    opened[t.data] = open(t.data, "rb")
                opened[t.data].seek(t.offset)
                raw = whole[base + start: base + start + t.length]
                if opened[t.data].readinto(memoryview(raw)) != t.length:
                    raise ArtifactError(f"{engine_dir}: {t.data.name} ended while reading {t.name}; rebuild the engine")
                self.arrays[t.name] = raw.view(t.dtype).reshape(t.shape)
        finally:
            for f in opened.values():
                f.close()
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.arrays.items()}

    @classmethod
    def load(cls, engine_dir: Path, manifest: dict) -> WeightArena | None:
        """The arena where huge pages are offered and our ops read weights from the graph's data files, else None."""
        if not huge_pages_offered():
            return None
        tensors = _tensors(engine_dir, manifest)
        return cls(engine_dir, tensors) if tensors else None

    def register(self, so: ort.SessionOptions) -> None:
        """Make `so`'s session read these initializers from the arena instead of mapping the data file."""
        for name, value in self.values.items():
            so.add_initializer(name, value)
