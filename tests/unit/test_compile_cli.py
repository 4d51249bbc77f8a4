"""`compile build` on bad input: one-line error, exit code 2, and nothing left behind."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from compile.cli import main


def run_build(model, out, *extra):
    return CliRunner().invoke(main, ["build", "--model", str(model), "--out", str(out), *extra])


def assert_clean_failure(result, out, needle):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


@pytest.fixture
def broken(checkpoint, tmp_path):
    def make(edit):
        dst = tmp_path / "ckpt"
        shutil.copytree(checkpoint("llama"), dst)
        edit(dst)
        return dst
    return make


def set_config(**changes):
    def edit(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return edit


def test_missing_model_dir(tmp_path):
    assert_clean_failure(run_build(tmp_path / "nope", tmp_path / "out"), tmp_path / "out", "not found")


def test_missing_tokenizer(broken, tmp_path):
    model = broken(lambda p: (p / "tokenizer.json").unlink())
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "tokenizer.json")


def test_unsupported_architecture(broken, tmp_path):
    model = broken(set_config(architectures=["GPT2LMHeadModel"]))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "unsupported architecture")


def test_unsupported_rope_scaling(broken, tmp_path):
    model = broken(set_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "rope_scaling")


def test_missing_weights(broken, tmp_path):
    model = broken(lambda p: (p / "model.safetensors").unlink())
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "safetensors")


def test_missing_tensor_leaves_nothing(broken, tmp_path):
    """A failure deep in the export (a tensor the config promises is absent) still leaves no artifact."""
    model = broken(set_config(num_hidden_layers=3))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "model.layers.2")


def test_existing_output_needs_overwrite(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_build(checkpoint("llama"), out).exit_code == 0
    result = run_build(checkpoint("llama"), out)
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert run_build(checkpoint("llama"), out, "--overwrite").exit_code == 0


def test_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("build", "inspect", "verify"):
        assert cmd in result.output


def test_int8_kv_cache_is_a_cpu_format(checkpoint, tmp_path):
    out = tmp_path / "out"
    result = run_build(checkpoint("llama"), out, "--target", "cuda", "--precision", "fp16", "--kv-cache", "int8")
    assert_clean_failure(result, out, "CPU format")
    assert run_build(checkpoint("llama"), out, "--kv-cache", "int8", "--no-report").exit_code == 0
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "KV cache int8" in shown and "BNSH int8" in shown
    verified = CliRunner().invoke(main, ["verify", str(out), "--model", str(checkpoint("llama"))])
    assert verified.exit_code == 0 and "PASS" in verified.output


def one_error_line(result, needle):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output
    assert "Traceback" not in result.output


def test_overwrite_never_deletes_a_folder_that_is_not_an_engine(checkpoint, tmp_path, monkeypatch):
    """`--out . --overwrite` wiped the current folder: only a folder with manifest.json is replaced."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    monkeypatch.chdir(work)
    one_error_line(run_build(checkpoint("llama"), ".", "--overwrite"), "not a Quicksilver engine (no manifest.json)")
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert (work / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("where", ["model", "inside model", "model inside out"])
def test_out_and_model_must_not_contain_each_other(broken, where):
    """`--out` equal to `--model` with --overwrite deleted the checkpoint."""
    model = broken(lambda p: None)
    before = sorted(p.name for p in model.iterdir())
    out = {"model": model, "inside model": model / "engine", "model inside out": model.parent}[where]
    needle = "--model" if where != "model inside out" else "is inside --out"
    one_error_line(run_build(model, out, "--overwrite"), needle)
    assert sorted(p.name for p in model.iterdir()) == before


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)])
def test_out_is_a_file(checkpoint, tmp_path, overwrite):
    out = tmp_path / "engine"
    out.write_text("not an engine")
    one_error_line(run_build(checkpoint("llama"), out, *overwrite), "is a file")
    assert out.read_text() == "not an engine"


def test_out_not_writable(checkpoint, tmp_path):
    one_error_line(run_build(checkpoint("llama"), "/proc/quicksilver-engine"), "cannot write the engine to /proc")
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        one_error_line(run_build(checkpoint("llama"), locked / "engine"), "cannot write the engine")


def test_overwrite_replaces_an_engine_or_an_empty_folder(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run_build(checkpoint("llama"), out, "--overwrite", "--no-report").exit_code == 0
    assert run_build(checkpoint("llama"), out, "--overwrite", "--no-report", "--precision", "fp16").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["precision"]["weights"] == "fp16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # no staging or old folder left beside it


def test_head_dim_not_a_multiple_of_16(broken, tmp_path):
    """8 heads over hidden 64 (tensor shapes still consistent): GroupQueryAttention's traceback came in the report."""
    model = broken(set_config(num_attention_heads=8, num_key_value_heads=4))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out",
                         "head_dim 8 (hidden_size / num_attention_heads, or config.json's head_dim) is not a "
                         "multiple of 16")


def test_context_option_has_the_runtime_name_too(checkpoint, tmp_path):
    """`compile build --max-model-len` (the name `runtime serve` uses) and the older `--max-seq-len` both set it."""
    from click.testing import CliRunner

    from compile.cli import main as cli

    for flag in ("--max-model-len", "--max-seq-len"):
        out = tmp_path / flag.strip("-")
        r = CliRunner().invoke(cli, ["build", "--model", str(checkpoint("llama")), "--out", str(out), flag, "96",
                                     "--no-report"])
        assert r.exit_code == 0, r.output
        assert json.loads((out / "manifest.json").read_text())["model"]["max_seq_len"] == 96


def test_kernels_choice(checkpoint, tmp_path, monkeypatch):
    """cpu engines take our ops when this install has them (auto): qs.CausalAttention (GroupQueryAttention with
    --kernels ort or an int8 KV cache) and qs.Int8MatMul in int8 linears; the manifest says which, `compile
    verify` passes either way, and a runtime built without our ops refuses a qs engine with what to do instead
    of ORT's missing-kernel error."""
    import onnx

    from runtime import cpu_ops
    from artifact.errors import ArtifactError
    from runtime.backends.cpu.runner import ModelRunner

    if not cpu_ops.available():
        pytest.skip("this install was built without the qs ops")
    model = checkpoint("llama")
    expect = {(): ("qs", "qs.CausalAttention", False),
              ("--kernels", "ort"): ("ort", "com.microsoft.GroupQueryAttention", False),
              ("--kv-cache", "int8"): ("qs", "com.microsoft.GroupQueryAttention", False),
              ("--kernels", "ort", "--precision", "int8"): ("ort", "com.microsoft.GroupQueryAttention", False),
              ("--precision", "int8"): ("qs", "qs.CausalAttention", True)}
    for i, (flags, (kernels, op, row_quantize)) in enumerate(expect.items()):
        out = tmp_path / f"e{i}"
        assert run_build(model, out, "--no-report", *flags).exit_code == 0
        precision = json.loads((out / "manifest.json").read_text())["precision"]
        assert (precision["kernels"], precision["attention"]) == (kernels, op)
        graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
        assert {f"{n.domain}.{n.op_type}" for n in graph.graph.node if "Attention" in n.op_type} == {op}
        layers = json.loads((out / "manifest.json").read_text())["model"]["num_layers"]
        # int8 with our kernels: every linear (4 a layer, and the head) is one qs.Int8MatMul, and the embedding
        # lookup reads the head's packed table (qs.PackedGather)
        ops = [n.op_type for n in graph.graph.node]
        assert ops.count("Int8MatMul") == (4 * layers + 1 if row_quantize else 0)
        assert ops.count("PackedGather") == (1 if row_quantize else 0)
        assert not row_quantize or not {"QuantizeLinear", "RowQuantize", "MatMulIntegerToFloat"} & set(ops)
        shown = CliRunner().invoke(main, ["inspect", str(out)]).output
        assert f"{kernels}: attention {op}" in shown, shown
        verified = CliRunner().invoke(main, ["verify", str(out), "--model", str(model)])
        assert verified.exit_code == 0 and "PASS" in verified.output, verified.output
    out = tmp_path / "bad"
    assert_clean_failure(run_build(model, out, "--kernels", "qs", "--target", "cuda", "--precision", "fp16"), out,
                         "--kernels qs are cpu ops")
    # int4: qs.Int4MatMul for every linear and the head, qs.Int4Gather for the lookup, where our ops have AVX-512
    # (else MatMulNBits); `compile verify` passes against the checkpoint either way
    for i, flags in enumerate([(), ("--kernels", "ort")]):
        out = tmp_path / f"int4-{i}"
        assert run_build(model, out, "--no-report", "--precision", "int4", *flags).exit_code == 0
        ops = [n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
        ours = not flags and cpu_ops.isa().startswith("avx512")
        layers = json.loads((out / "manifest.json").read_text())["model"]["num_layers"]
        assert (ops.count("Int4MatMul"), ops.count("Int4Gather")) == ((4 * layers + 1, 1) if ours else (0, 0))
        assert ("MatMulNBits" in ops) == (not ours)
        verified = CliRunner().invoke(main, ["verify", str(out), "--model", str(model)])
        assert verified.exit_code == 0 and "PASS" in verified.output, verified.output
    monkeypatch.setattr(cpu_ops, "library", lambda: None)
    with pytest.raises(ArtifactError, match="--kernels ort"):
        ModelRunner(tmp_path / "e0")


def test_bf16_attention_products(checkpoint, tmp_path):
    """--attention-products bf16: every qs.CausalAttention node carries bf16_products, the manifest and `inspect`
    say so, and `compile verify` passes (int8 bounds); asked of an engine whose cache is not fp16 on our op, the
    build fails cleanly with what to use instead."""
    import onnx

    from runtime import cpu_ops

    if not cpu_ops.available():
        pytest.skip("this install was built without the qs ops")
    model = checkpoint("llama")
    out = tmp_path / "bf16"
    built = run_build(model, out, "--precision", "int8", "--attention-products", "bf16")
    assert built.exit_code == 0, built.output        # with its accuracy report, against an exact fp32 baseline
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"]["attention_products"] == "bf16" and manifest["kv_cache"]["dtype"] == "float16"
    assert "accuracy" in manifest
    nodes = [n for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
             if n.op_type == "CausalAttention"]
    assert len(nodes) == manifest["model"]["num_layers"]
    assert all(onnx.helper.get_node_attr_value(n, "bf16_products") == 1 for n in nodes)
    assert "bf16 products" in CliRunner().invoke(main, ["inspect", str(out)]).output
    verified = CliRunner().invoke(main, ["verify", str(out), "--model", str(model)])
    assert verified.exit_code == 0 and "PASS" in verified.output, verified.output
    for flags, needle in ((("--kv-cache", "fp32"), "--kv-cache fp16"), (("--precision", "fp32"), "--kv-cache fp16"),
                          (("--kernels", "ort"), "--kernels qs or auto"),
                          (("--target", "cuda", "--precision", "fp16"), "--target cpu")):
        bad = tmp_path / "bad"
        assert_clean_failure(run_build(model, bad, "--no-report", "--attention-products", "bf16", *flags), bad, needle)
