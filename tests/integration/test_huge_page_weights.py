"""An engine's weights read onto huge pages (runtime/backends/cpu/weights.py): the session reads the weights our ops
compute with from the arena and computes exactly what it computes on ONNX Runtime's own mapping of the data file,
leaves what ONNX Runtime repacks on that mapping, and refuses a data file that does not hold what the graph says."""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest

from artifact.errors import ArtifactError
from runtime.backends.cpu import weights
from runtime.kv import memory
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


def read_by_our_ops(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The graph's external initializers that only `qs` nodes read (what the arena holds)."""
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.domain)
    return [t for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL and readers.get(t.name) == {"qs"}]


@pytest.mark.skipif(not weights.huge_pages_offered(), reason="this kernel offers no transparent huge pages")
@pytest.mark.parametrize("name, precision", [("qwen2", "int4"), ("llama", "int8")])
def test_weights_on_huge_pages_are_what_the_session_computes_with(engine, name, precision):
    path = engine(name, precision)
    data = path / "model.onnx.data"
    runner = ModelRunner(path)
    arena = runner.weights
    ours = read_by_our_ops(onnx.load(str(path / "model.onnx"), load_external_data=False))
    assert arena is not None and sorted(arena.values) == sorted(t.name for t in ours)
    assert all(arena.address <= v.data_ptr() < arena.address + arena.nbytes for v in arena.values.values())
    assert 0.9 * data.stat().st_size <= arena.nbytes <= data.stat().st_size + 64 * len(arena.values)   # the linears
    assert arena_smaps(arena.address)["THPeligible"] == "1"
    mapped = ModelRunner(path, huge_pages=False)
    assert mapped.weights is None and maps_of(data) > 0
    expected = run_steps(mapped)
    for a, b in zip(run_steps(runner), expected, strict=True):
        np.testing.assert_array_equal(a, b)
    # the session reads the arena itself: a weight changed there changes the logits, and changed back restores them
    biggest = max(arena.arrays.values(), key=lambda a: a.nbytes)
    kept = biggest.copy()
    biggest[...] = 0
    assert not np.array_equal(run_steps(runner)[0], expected[0])
    biggest[...] = kept
    np.testing.assert_array_equal(run_steps(runner)[0], expected[0])


@pytest.mark.skipif(not weights.huge_pages_offered(), reason="this kernel offers no transparent huge pages")
def test_weights_onnx_runtime_repacks_stay_on_its_mapping(engine):
    """An fp32 engine's MatMul weights are repacked by ONNX Runtime at load: an arena copy would only double them."""
    path = engine("mistral")
    runner = ModelRunner(path)
    ours = {t.name for t in read_by_our_ops(onnx.load(str(path / "model.onnx"), load_external_data=False))}
    assert set(runner.weights.values if runner.weights else ()) == ours
    assert runner.weights is None or runner.weights.nbytes < 0.1 * (path / "model.onnx.data").stat().st_size
    assert maps_of(path / "model.onnx.data") > 0
    for a, b in zip(run_steps(runner), run_steps(ModelRunner(path, huge_pages=False)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_arena_where_the_kernel_offers_no_huge_pages(engine, tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(memory, "THP_ENABLED", setting)
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
    """A copy of `engine_dir` whose graph had `edit(tensors our ops read, data_file)` applied."""
    out = tmp_path / "forged"
    shutil.copytree(engine_dir, out)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    edit(read_by_our_ops(model), out / "model.onnx.data")
    onnx.save(model, str(out / "model.onnx"))
    return out


def claim_whole_file(tensors: list[onnx.TensorProto], data) -> None:
    """Every uint8 tensor (int4's packed weights) names the whole data file: the same bytes, many times over."""
    for t in (t for t in tensors if t.data_type == onnx.TensorProto.UINT8):
        del t.dims[:]
        t.dims.append(data.stat().st_size)
        set_entry(t, "offset", "0")
        set_entry(t, "length", str(data.stat().st_size))


@pytest.mark.skipif(not weights.huge_pages_offered(), reason="this kernel offers no transparent huge pages")
@pytest.mark.parametrize("precision, edit, says", [
    ("int8", lambda ts, data: data.write_bytes(data.read_bytes()[:1000]), "lies outside"),     # a truncated file
    ("int8", lambda ts, data: set_entry(ts[0], "length", str(int(entry(ts[0], "length")) + 4)), "its shape"),
    ("int8", lambda ts, data: set_entry(ts[0], "offset", str(1 << 40)), "lies outside"),
    ("int8", lambda ts, data: set_entry(ts[0], "offset", "-64"), "lies outside"),
    ("int8", lambda ts, data: set_entry(ts[0], "length", "many"), "no valid external location"),
    ("int8", lambda ts, data: set_entry(ts[0], "location", "../model.onnx.data"), "not a file the manifest lists"),
    ("int8", lambda ts, data: ts[0].dims.__setitem__(0, -ts[0].dims[0]), "negative dimension"),
    ("int4", claim_whole_file, "claim"),
])
def test_a_data_file_that_does_not_hold_the_graphs_tensors_is_refused(engine, tmp_path, precision, edit, says):
    path = forged(engine("llama", precision), tmp_path, edit)
    with pytest.raises(ArtifactError, match=says):
        ModelRunner(path, verify=False)          # the manifest's hashes would refuse the edit first
