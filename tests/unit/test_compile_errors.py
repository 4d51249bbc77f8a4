"""A checkpoint that disagrees with its config.json, or files that are not what their names say: `compile build`
fails before building, with one line naming the tensor or file, exit code 2, and leaves nothing behind."""

import json
import shutil
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from test_compile_cli import assert_clean_failure, run_build

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    def copy(name: str = "llama"):
        dst = tmp_path / "ckpt"
        shutil.copytree(checkpoint(name), dst)
        return dst
    return copy


def edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_tensor_shape_disagrees_with_config(copy_of, tmp_path):
    model = copy_of()
    edit_tensors(model, lambda t: t.update({Q_PROJ: np.zeros((100, 64), np.float32)}))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out",
                         f"model.safetensors: tensor {Q_PROJ} has shape [100, 64], config.json implies [64, 64]")


def test_integer_weights(copy_of, tmp_path):
    model = copy_of()
    edit_tensors(model, lambda t: t.update({k: v.astype(np.int32) for k, v in t.items()}))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out",
                         "tensor model.embed_tokens.weight has dtype I32, expected one of F32, F16, BF16, F64")


def test_bias_shape_is_checked_too(copy_of, tmp_path):
    model = copy_of("qwen2")
    edit_tensors(model, lambda t: t.update({"model.layers.1.self_attn.v_proj.bias": np.zeros(31, np.float32)}))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out",
                         "tensor model.layers.1.self_attn.v_proj.bias has shape [31], config.json implies [32]")


@pytest.mark.parametrize("content, needle", [
    (np.random.default_rng(0).bytes(4096), "is not a safetensors file (header length"),
    (struct.pack("<Q", 10**12) + b"{}" * 100, "header length 1000000000000 exceeds the file's 208 bytes"),
    (struct.pack("<Q", 2) + b"[]", "its header is not a JSON object"),
    (struct.pack("<Q", 80) + json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}).encode()
     .ljust(80) + bytes(16), "tensor w has shape [4, 4] but 16 bytes of F32"),
    (b"\x01\x02", "is not a readable safetensors file"),
])
def test_not_a_safetensors_file(copy_of, tmp_path, content, needle):
    model = copy_of()
    (model / "model.safetensors").write_bytes(content)
    result = run_build(model, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", needle)
    assert "model.safetensors" in result.output


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": {"x": "../x.safetensors"}}'])
def test_corrupt_index_names_the_file(copy_of, tmp_path, index):
    model = copy_of("qwen2-bf16-sharded")
    (model / "model.safetensors.index.json").write_text(index)
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out",
                         f"{model / 'model.safetensors.index.json'} is not a valid safetensors index")
