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

import numpy as np
import onnxruntime as ort

import artifact
from artifact.errors import ArtifactError

from ... import cpu_ops

HUGE_PAGE = 2 << 20
ALIGN = 64                  # each tensor starts on a cache line (ONNX Runtime's own alignment)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give anonymous memory transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_ENABLED.read_text()
    except OSError:
        return False


def _numpy_dtype(data_type: int) -> np.dtype | None:
    """The numpy dtype an OrtValue can be made from for an ONNX element type (None: leave that tensor to ORT)."""
    import onnx

    plain = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
             onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8,
             onnx.TensorProto.INT16: np.int16, onnx.TensorProto.UINT16: np.uint16, onnx.TensorProto.INT32: np.int32,
             onnx.TensorProto.UINT32: np.uint32, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.UINT64: np.uint64,
             onnx.TensorProto.BOOL: np.bool_}
    return np.dtype(plain[data_type]) if data_type in plain else None


def _tensors(engine_dir: Path, manifest: dict) -> list[tuple[str, np.dtype, tuple[int, ...], Path, int, int]]:
    """(name, dtype, shape, data file, offset, length) of each external initializer that only `qs` nodes read,
    checked against the listed data files."""
    import onnx

    graph = artifact.graph_path(engine_dir, manifest)
    model = onnx.load(str(graph), load_external_data=False)
    readers: dict[str, set[str]] = defaultdict(set)
    for node in model.graph.node:
        for name in node.input:
            readers[name].add(node.domain)
    tensors = []
    for t in model.graph.initializer:
        dtype = _numpy_dtype(t.data_type)
        if t.data_location != onnx.TensorProto.EXTERNAL or dtype is None or readers[t.name] != {cpu_ops.DOMAIN}:
            continue
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
        tensors.append((t.name, dtype, shape, data, offset, length))
    return tensors


class WeightArena:
    """The initializers only our ops read, from the engine's listed data files into one huge-page arena.

    `register(so)` hands them to a session; the arena must outlive that session (the runner keeps it, and ties it
    to the session object too)."""

    def __init__(self, engine_dir: Path, tensors: list[tuple[str, np.dtype, tuple[int, ...], Path, int, int]]):
        starts, end = [], 0
        for *_, length in tensors:
            starts.append(end)
            end += -(-length // ALIGN) * ALIGN
        files = {data: data.stat().st_size for *_, data, _, _ in tensors}
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
            for (name, dtype, shape, data, offset, length), start in zip(tensors, starts):
                if data not in opened:
                    opened[data] = open(data, "rb")
                opened[data].seek(offset)
                raw = whole[base + start: base + start + length]
                if opened[data].readinto(memoryview(raw)) != length:
                    raise ArtifactError(f"{engine_dir}: {data.name} ended while reading {name}; rebuild the engine")
                self.arrays[name] = raw.view(dtype).reshape(shape)
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
