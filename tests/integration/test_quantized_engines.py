"""Every precision builds, loads, generates, and reports its accuracy; quantized graphs compute what their
scheme says (checked against the numpy reference on checkpoints whose weights are exactly representable)."""

import shutil

from functools import partial

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from runtime import cpu_ops
from artifact import load
from compile.build import build
from compile.cli import main
from compile.graph import layers
from compile.config import CompileConfig, QuantConfig
from compile.quantize import fp8, int8, kv_int8
from compile.reference import ReferenceModel
from compile.hf_source import CheckpointReader, read_spec
from runtime.backends.cpu.slots import SlotRange
from runtime.backends.cpu.runner import ModelRunner

PRECISIONS = ["fp16", "int8", "int4", "fp8"]


def logits(engine_dir, prompt):
    runner = ModelRunner(engine_dir)
    n = len(prompt)
    return runner.execute(np.asarray([prompt], np.int64), np.array([n - 1], np.int32), np.arange(n),
                          runner.new_pool(1, n), SlotRange(0, 1)).copy()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_builds_reports_and_generates(precision, checkpoint, tmp_path):
    out = tmp_path / precision
    manifest = build(CompileConfig(checkpoint("qwen2"), out, precision), log=lambda _: None)
    acc = load(out)["accuracy"]
    assert acc == manifest["accuracy"] and acc["tokens"] > 500
    # A quantized model is no better than fp32 beyond noise, and agrees with it on most tokens.
    assert acc["perplexity_increase_pct"] > -1.0
    assert acc["top1_agreement"] > 0.6
    result = CliRunner().invoke(main, ["inspect", str(out)])
    assert "perplexity" in result.output and precision in result.output
    prompt = list(range(3, 40))
    assert np.isfinite(logits(out, prompt)).all()


def test_sizes_follow_precision(checkpoint, tmp_path):
    """Weight bytes (the external data file) shrink with precision; smollm2-scale ratios are in README."""
    sizes = {}
    for precision in ["fp32", "int8", "fp8", "int4"]:
        out = tmp_path / precision
        build(CompileConfig(checkpoint("llama"), out, precision, report=False), log=lambda _: None)
        sizes[precision] = (out / "model.onnx.data").stat().st_size
    assert sizes["fp32"] / sizes["int8"] > 3.0 and sizes["fp32"] / sizes["fp8"] > 3.0
    assert sizes["fp32"] / sizes["int4"] > 4.5


def exact_checkpoint(src, dst, quantizer, axis=0):
    """Copy a checkpoint with every matrix replaced by its own quantize→dequantize (exactly representable)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, w in tensors.items():
        if w.ndim == 2:
            # HF linears are [out, in]; the compiler quantizes [in, out] per output channel, and the
            # embedding per row: both are per-row of the HF layout.
            q, s = quantizer(w.astype(np.float32), axis=1)
            tensors[name] = (q.astype(np.float32) * s[:, None]).astype(np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_fp8_engine_is_exact_on_fp8_weights(checkpoint, tmp_path):
    """fp8 weights are dequantized once at load: on fp8-representable weights the engine equals the reference."""
    model = exact_checkpoint(checkpoint("llama"), tmp_path / "ck", fp8.quantize)
    out = tmp_path / "fp8"
    manifest = build(CompileConfig(model, out, "fp8", report=False), log=lambda _: None)
    assert manifest["precision"]["session_config"] == {"session.disable_quant_qdq": "1"}
    prompt = list(range(5, 60))
    want = ReferenceModel(read_spec(model), CheckpointReader(model)).forward(prompt)
    assert np.abs(logits(out, prompt) - want).max() < 1e-3


@pytest.mark.parametrize("name", ["llama", "qwen2"])       # qwen2: q/k/v biases
def test_int8_engine_error_is_activation_quantization_only(checkpoint, tmp_path, name):
    """On weights the int8 grid represents exactly, the only error left is the activations' (per row, 8 bits)."""
    model = exact_checkpoint(checkpoint(name), tmp_path / "ck", partial(int8.quantize, levels=int8.WEIGHT_LEVELS))
    out = tmp_path / "int8"
    build(CompileConfig(model, out, "int8", report=False), log=lambda _: None)
    prompt = list(range(5, 60))
    want = ReferenceModel(read_spec(model), CheckpointReader(model)).forward(prompt)
    got = logits(out, prompt)
    assert np.abs(got - want).max() < 0.05 and (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_int4_embedding_lookup_matches_head_table(checkpoint, tmp_path):
    """int4 tied embeddings: the in-graph nibble unpacking must match the 4-bit table the head uses.
    A one-token prompt's logits depend on the looked-up row, so compare against int8-embedding builds."""
    model = checkpoint("qwen2")
    results = {}
    for emb in ("quantized", "fp32"):
        out = tmp_path / emb
        build(CompileConfig(model, out, "int4", quant=QuantConfig(embeddings=emb), report=False), log=lambda _: None)
        results[emb] = logits(out, list(range(10, 50)))
    # Same int4 layers, different embedding precision: close, and far closer than a wrong unpacking would be.
    assert np.abs(results["quantized"] - results["fp32"]).max() < 0.15


def test_awq_build_and_report(checkpoint, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("def add(a, b):\n    return a + b\n" * 50)
    out = tmp_path / "awq"
    manifest = build(CompileConfig(checkpoint("llama"), out, "int4", quant=QuantConfig(calib=calib)), log=lambda _: None)
    assert manifest["precision"]["awq"] is True and "accuracy" in manifest


@pytest.mark.parametrize("args,needle", [
    (["--precision", "int3"], "int3"),
    (["--precision", "int4", "--block-size", "48"], "power of two"),
    (["--precision", "int4", "--block-size", "128"], "does not divide"),
    (["--precision", "int4", "--calib", "/nonexistent/calib.txt"], "calibration file not found"),
    (["--precision", "int8", "--calib", "{model}/config.json"], "int4 only"),
    (["--precision", "int8", "--eval", "/nonexistent/eval.txt"], "evaluation file not found"),
    (["--precision", "int8", "--kv-cache", "fp16", "--kernels", "ort"], "GroupQueryAttention"),
])
def test_bad_options(args, needle, checkpoint, tmp_path):
    out = tmp_path / "out"
    model = checkpoint("llama")
    args = [a.format(model=model) for a in args]
    result = CliRunner().invoke(main, ["build", "--model", str(model), "--out", str(out), *args])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not out.exists()


def logit_errors(runner: ModelRunner, pool, prompt: list[int], tokens: list[int], *refs: ReferenceModel) -> list[list[float]]:
    """Per reference: max |engine − reference| logits of the prompt's prefill, then of each decode step feeding
    `tokens` (every reference steps along, so each sees the same sequence)."""
    got = runner.prefill(pool, 0, prompt, 0, all_logits=True)
    errors = [[float(np.abs(got - ref.forward(prompt)).max())] for ref in refs]
    for step, token in enumerate(tokens):
        got = runner.decode(pool, [(0, token, len(prompt) + step)], set())
        for e, ref in zip(errors, refs):
            e.append(float(np.abs(got - ref.forward([token])).max()))
    return errors


def test_int8_kv_cache_equals_the_reference_reading_the_same_quantized_cache(checkpoint, tmp_path):
    """--kv-cache int8: GroupQueryAttention stores K (after rotary) and V as round(x / scale), clipped, with one
    calibrated scale per (KV head, channel); the engine equals the float64 reference whose attention reads the
    same quantized K/V — over a prompt and decode steps — and costs little next to the fp32 cache."""
    model, out = checkpoint("qwen2"), tmp_path / "kv8"
    manifest = build(CompileConfig(model, out, "fp32", kv_cache="int8"), log=lambda _: None)
    assert manifest["kv_cache"]["dtype"] == "int8" and manifest["precision"]["kv_cache"] == "int8"
    acc = manifest["accuracy"]
    assert abs(acc["perplexity_increase_pct"]) < 1.0 and acc["top1_agreement"] > 0.95
    spec = read_spec(model)
    scales = kv_int8.engine_scales(out / "model.onnx", spec.num_layers)
    assert scales[0][0].shape == (1, spec.num_kv_heads, 1, spec.head_dim)
    quantized = ReferenceModel(spec, CheckpointReader(model), kv_scales=scales)
    plain = ReferenceModel(spec, CheckpointReader(model))
    runner = ModelRunner(out)
    pool, prompt = runner.new_pool(1, 64), list(range(5, 45))
    assert pool.keys[0].dtype == np.int8
    errors, against_plain = logit_errors(runner, pool, prompt, [7, 300, 12, 99], quantized, plain)
    assert max(errors) < 1e-4, errors
    # The quantization is visible against the unquantized reference (the prompt's prefill), so the comparison
    # above can fail.
    assert against_plain[0] > 10 * max(errors)


@pytest.mark.skipif(not cpu_ops.available(), reason="this install was built without the qs ops")
def test_fp16_kv_cache_equals_the_reference_reading_the_same_rounded_cache(checkpoint, tmp_path):
    """--kv-cache fp16: qs.CausalAttention stores K (after rotary) and V as float16 and computes in float32; the
    engine equals the float64 reference whose attention reads K/V rounded to float16, over a prompt and decode
    steps, and the rounding is visible against the unrounded reference (so the comparison can fail)."""
    model, out = checkpoint("qwen2"), tmp_path / "kv16"
    manifest = build(CompileConfig(model, out, "fp32", kv_cache="fp16"), log=lambda _: None)
    assert manifest["kv_cache"]["dtype"] == "float16" and manifest["precision"]["attention"] == "qs.CausalAttention"
    acc = manifest["accuracy"]
    assert abs(acc["perplexity_increase_pct"]) < 0.1 and acc["top1_agreement"] > 0.99
    spec = read_spec(model)
    rounded = ReferenceModel(spec, CheckpointReader(model), kv_half=True)
    plain = ReferenceModel(spec, CheckpointReader(model))
    runner = ModelRunner(out)
    pool, prompt = runner.new_pool(1, 64), list(range(5, 45))
    build(CompileConfig(model, tmp_path / "kv32", "fp32", report=False), log=lambda _: None)
    assert pool.keys[0].dtype == np.float16
    assert 2 * pool.token_bytes == ModelRunner(tmp_path / "kv32").new_pool(1, 64).token_bytes     # half the memory
    errors, against_plain = logit_errors(runner, pool, prompt, [7, 300, 12, 99], rounded, plain)
    assert max(errors) < 1e-4, errors
    assert max(against_plain) > 10 * max(errors), (errors, against_plain)


@pytest.mark.skipif(not cpu_ops.available(), reason="this install was built without the qs ops")
@pytest.mark.parametrize("precision,kernels,kv", [("int8", "auto", "float16"), ("int4", "auto", "float16"),
                                                   ("fp32", "auto", "float32"), ("int8", "ort", "float32")])
def test_kv_cache_auto(checkpoint, tmp_path, precision, kernels, kv):
    """The default (--kv-cache auto): fp16 where our attention op runs a quantized engine; an fp32 engine stays the
    exact reference, and ONNX Runtime's GroupQueryAttention (--kernels ort) keeps its fp32 cache."""
    manifest = build(CompileConfig(checkpoint("llama"), tmp_path / "e", precision, report=False, kernels=kernels),
                     log=lambda _: None)
    assert manifest["kv_cache"]["dtype"] == kv


@pytest.mark.parametrize("name,precision", [("qwen2", "int4"), ("llama", "int4"), ("qwen2", "int8"), ("llama", "int8")])
def test_linears_fold_the_ops_around_them_bit_for_bit(name, precision, checkpoint, tmp_path, monkeypatch):
    """With qs.Int4MatMul or qs.Int8MatMul the norms, SwiGLU and attention biases around the linears are folded into
    them (one op where a decode step ran two or three): the graph has none of those nodes left but the first and last
    norms, and its logits — a prompt, a chunk after it, decode at batch 1 and 3 — are bitwise those of the same
    checkpoint built without folding."""
    folded, plain, op = tmp_path / "folded", tmp_path / "plain", f"Int{precision[-1]}MatMul"
    build(CompileConfig(checkpoint(name), folded, precision, report=False), log=lambda _: None)
    ops = [n.op_type for n in onnx.load(folded / "model.onnx", load_external_data=False).graph.node]
    if op not in ops:
        pytest.skip(f"this install builds {precision} engines without qs.{op}")
    monkeypatch.setattr(layers, "linears_fold", lambda ctx: False)
    build(CompileConfig(checkpoint(name), plain, precision, report=False), log=lambda _: None)
    plain_ops = [n.op_type for n in onnx.load(plain / "model.onnx", load_external_data=False).graph.node]
    layers_n = read_spec(checkpoint(name)).num_layers
    assert ops.count("SkipSimplifiedLayerNormalization") == 1 and "SwiGLU" not in ops and "Add" not in ops
    assert plain_ops.count("SkipSimplifiedLayerNormalization") == 2 * layers_n
    assert plain_ops.count("SwiGLU") == layers_n and ops.count(op) == plain_ops.count(op)
    assert plain_ops.count("Add") == (layers_n if name == "qwen2" else 0)       # qwen2's q/k/v biases

    ids = [int(t) for t in np.random.default_rng(7).integers(3, 200, 40)]
    got = {}
    for label, engine_dir in (("folded", folded), ("plain", plain)):
        runner = ModelRunner(engine_dir)
        pool = runner.new_pool(4, 64)
        out = [np.array(runner.prefill(pool, 0, ids[:30], 0)), np.array(runner.prefill(pool, 0, ids[30:], 30))]
        for slot in (1, 2, 3):
            runner.prefill(pool, slot, ids[:20 + slot], 0)
        out.append(runner.decode(pool, [(1, 5, 21)], set()))
        out.append(runner.decode(pool, [(1, 6, 22), (2, 7, 22), (3, 8, 23)], set()))
        got[label] = out
    for a, b in zip(got["folded"], got["plain"]):
        assert a.shape == b.shape and np.array_equal(a, b)
