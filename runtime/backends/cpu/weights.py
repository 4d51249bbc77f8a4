"""An engine's weights read into one anonymous arena on transparent huge pages, and handed to ONNX Runtime in place.

ONNX Runtime maps each external initializer straight from the engine's data file, onto 4 KiB page-cache pages. A
batch-1 decode step streams every weight once, and on 4 KiB pages the TLB misses and the hardware prefetchers
(which stop at page edges) cost it bandwidth: on an AMD EPYC Zen 4 a 512 MiB two-thread numpy read ran 33.2 GB/s
on huge pages and 29.6 GB/s on 4 KiB ones, and numpy's reading is what tools/bench_decode.py takes as the bound.
The arena is read once at load (the pages the mapping would have faulted in, so the resident size is the same)
and registered with SessionOptions.add_initializer, which uses the memory where it lies: nothing is copied again.

Where the kernel offers no transparent huge pages (THP "never", not Linux), ONNX Runtime keeps its own mapping.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnxruntime as ort

import artifact
from artifact.errors import ArtifactError

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


class WeightArena:
    """The graph's external initializers, read from the engine's listed data files into one huge-page arena.

    `register(so)` hands them to a session; the arena must outlive that session (the runner keeps it)."""

    def __init__(self, engine_dir: Path, manifest: dict):
        import onnx

        graph = artifact.graph_path(engine_dir, manifest)
        model = onnx.load(str(graph), load_external_data=False)
        tensors = []                                    # (name, dtype, shape, data file, offset, length)
        for t in model.graph.initializer:
            dtype = _numpy_dtype(t.data_type)
            if t.data_location != onnx.TensorProto.EXTERNAL or dtype is None:
                continue
            info = {e.key: e.value for e in t.external_data}
            try:
                offset, length = int(info.get("offset", 0)), int(info["length"])
            except (KeyError, ValueError):
                raise ArtifactError(f"{engine_dir}: initializer {t.name} has no valid external offset and length; "
                                    "rebuild the engine") from None
            shape = tuple(int(d) for d in t.dims)
            data = artifact.data_path(engine_dir, manifest, graph, info["location"])
            if length != int(np.prod(shape)) * dtype.itemsize or offset < 0 or offset + length > data.stat().st_size:
                raise ArtifactError(f"{engine_dir}: initializer {t.name} ({length} bytes at {offset}) does not fit its "
                                    f"shape {list(shape)} or lies past the end of {info['location']}; rebuild the engine")
            tensors.append((t.name, dtype, shape, data, offset, length))
        starts, end = [], 0
        for *_, length in tensors:
            starts.append(end)
            end += -(-length // ALIGN) * ALIGN
        self.nbytes = end
        size = -(-max(end, 1) // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._map, np.uint8)
        base = -whole.ctypes.data % HUGE_PAGE          # the first huge-page boundary inside the mapping
        self._map.madvise(mmap.MADV_HUGEPAGE, base, size)
        self.address = whole.ctypes.data + base
        self.values: dict[str, ort.OrtValue] = {}
        files = {}
        try:
            for (name, dtype, shape, data, offset, length), start in zip(tensors, starts):
                f = files.get(data) or files.setdefault(data, open(data, "rb"))
                f.seek(offset)
                raw = whole[base + start: base + start + length]
                if f.readinto(memoryview(raw)) != length:
                    raise ArtifactError(f"{engine_dir}: {data.name} ended while reading {name}; rebuild the engine")
                self.values[name] = ort.OrtValue.ortvalue_from_numpy(raw.view(dtype).reshape(shape))
        finally:
            for f in files.values():
                f.close()

    @classmethod
    def load(cls, engine_dir: Path, manifest: dict) -> WeightArena | None:
        """The arena where huge pages are offered and the graph keeps its weights outside it, else None."""
        if not huge_pages_offered():
            return None
        arena = cls(engine_dir, manifest)
        return arena if arena.values else None

    def register(self, so: ort.SessionOptions) -> None:
        """Make `so`'s session read these initializers from the arena instead of mapping the data file."""
        for name, value in self.values.items():
            so.add_initializer(name, value)
