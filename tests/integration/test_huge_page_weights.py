"""An engine's weights read onto huge pages (runtime/backends/cpu/weights.py): the session computes exactly what it
computes on ONNX Runtime's own mapping of the data file, reads them from the arena, and refuses a data file that
does not hold what the graph says."""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest

from artifact.errors import ArtifactError
from runtime.backends.cpu import weights
from runtime.backends.cpu.runner import ModelRunner
from runtime.backends.cpu.slots import SlotRange


def maps_of(path) -> int:
    """How many of this process's mappings are of `path`."""
    name = str(path.resolve())
    return sum(1 for line in open(f"/proc/{os.getpid()}/maps") if line.rstrip().endswith(name))


def arena_smaps(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields, inside = {}, False
    for line in open(f"/proc/{os.getpid()}/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def run_steps(runner: ModelRunner) -> list[np.ndarray]:
    """A prompt's logits, then three batch-2 decode steps' (each a fresh copy)."""
    prompt = list(range(3, 40))
    pool = runner.new_pool(2, 64)
    out = [runner.execute(np.asarray([prompt, prompt], np.int64), np.array([36, 36], np.int32), np.arange(74), pool,
                          SlotRange(0, 2)).copy()]
    tokens = np.array([[5], [9]], np.int64)
    for step in range(3):
        logits = runner.execute(tokens, np.array([37 + step] * 2, np.int32), np.arange(2), pool, SlotRange(0, 2))
        out.append(logits.copy())
        tokens = logits.argmax(-1).astype(np.int64)[:, None]
    return out


@pytest.mark.skipif(not weights.huge_pages_offered(), reason="this kernel offers no transparent huge pages")
@pytest.mark.parametrize("name, precision", [("qwen2", "int4"), ("llama", "int8"), ("mistral", "fp32")])
def test_weights_on_huge_pages_compute_what_the_mapped_file_computes(engine, name, precision):
    path = engine(name, precision)
    data = path / "model.onnx.data"
    arena = ModelRunner(path)
    assert arena.weights is not None and maps_of(data) == 0          # the session reads the arena, not the file
    assert 0.99 * data.stat().st_size <= arena.weights.nbytes <= data.stat().st_size + 64 * len(arena.weights.values)
    assert arena_smaps(arena.weights.address)["THPeligible"] == "1"
    mapped = ModelRunner(path, huge_pages=False)
    assert mapped.weights is None and maps_of(data) > 0
    for a, b in zip(run_steps(arena), run_steps(mapped), strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_arena_where_the_kernel_offers_no_huge_pages(engine, tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(weights, "THP_ENABLED", setting)
    assert not weights.huge_pages_offered()
    path = engine("llama")
    runner = ModelRunner(path)
    assert runner.weights is None and maps_of(path / "model.onnx.data") > 0
    assert np.isfinite(run_steps(runner)[-1]).all()


def set_entry(tensor: onnx.TensorProto, key: str, value: str) -> None:
    """Set (or add) one of an initializer's external-data entries."""
    entry = next((e for e in tensor.external_data if e.key == key), None) or tensor.external_data.add(key=key)
    entry.value = value


def entry(tensor: onnx.TensorProto, key: str) -> str:
    return next(e.value for e in tensor.external_data if e.key == key)


def forged(engine_dir, tmp_path, edit):
    """A copy of `engine_dir` whose graph's first external initializer had `edit(tensor, data_file)` applied."""
    out = tmp_path / "forged"
    shutil.copytree(engine_dir, out)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    first = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    edit(first, out / "model.onnx.data")
    onnx.save(model, str(out / "model.onnx"))
    return out


@pytest.mark.skipif(not weights.huge_pages_offered(), reason="this kernel offers no transparent huge pages")
@pytest.mark.parametrize("edit, says", [
    (lambda t, data: data.write_bytes(data.read_bytes()[:1000]), "lies past the end"),     # a truncated data file
    (lambda t, data: set_entry(t, "length", str(int(entry(t, "length")) + 4)), "does not fit its shape"),
    (lambda t, data: set_entry(t, "offset", str(1 << 40)), "lies past the end"),
    (lambda t, data: set_entry(t, "offset", "-64"), "lies past the end"),
    (lambda t, data: set_entry(t, "length", "many"), "no valid external offset and length"),
    (lambda t, data: set_entry(t, "location", "../model.onnx.data"), "not a file the manifest lists"),
])
def test_a_data_file_that_does_not_hold_the_graphs_tensors_is_refused(engine, tmp_path, edit, says):
    path = forged(engine("llama", "int8"), tmp_path, edit)
    with pytest.raises(ArtifactError, match=says):
        ModelRunner(path, verify=False)          # the manifest's hashes would refuse the edit first
