"""`compile build`: checkpoint → ONNX graph → engine artifact, written atomically."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer

from tqdm import tqdm

from artifact import INT_SCALES_FORMAT_VERSION, check_destination, staging_dir, write_manifest

from . import __version__
from .archs import REGISTRY
from .config import KV_CACHE_NUMPY, CompileConfig, QuantConfig
from .quantize import report
from .quantize.awq import awq_reader
from .graph.builder import OPSET, GraphBuilder
from .graph.layers import MIN_ROWS, Ctx
from .hf_source import (CheckpointReader, ModelSpec, fingerprint, json_object, read_spec, token_ids,
                        tokenizer_files)
from .errors import CheckpointError

GRAPH_FILE, DATA_FILE = "model.onnx", "model.onnx.data"
CALIB_TOKENS = 512
# What the compiler emits for the same checkpoint and options; bumped when that changes (2: qs.Int8MatMul, 3: an
# fp16 KV cache by default where qs.CausalAttention runs a quantized engine, and qs.SwiGLU; 4: our int8 and int4
# linears take in the norms, SwiGLU and biases around them; 5: qs.CausalAttention engines take packed steps), so
# engines built before — the bundled ones above all — are known to be older graphs and rebuilt (runtime.bundled).
GRAPH_REVISION = 5


def _kv_record(spec: ModelSpec, cfg: CompileConfig, max_len: int) -> dict:
    """The manifest's KV layout: the cpu target's slot buffers (past ≡ present) or the GPU targets' paged cache."""
    common = {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
              "max_seq_len": max_len, "shared_buffer": True, "rotary_applied": True}
    if cfg.target != "cpu":
        return {"layout": "paged [num_blocks, block_size, kv_heads, head_dim]", "dtype": "float16", **common,
                "block_size": 16, "cache": "key_cache.{layer}, value_cache.{layer}",
                "cache_out": "key_cache_out.{layer}, value_cache_out.{layer}",
                "note": "the cache outputs alias the inputs (updated in place); block_size is the runtime's default, "
                        "any works"}
    record = {"layout": "BNSH", "dtype": KV_CACHE_NUMPY[cfg.kv_cache], **common,
              "past": "past_key_values.{layer}.{key|value}", "present": "present.{layer}.{key|value}",
              "note": "present must be bound to the same buffer as past; K is stored after rotary"}
    if cfg.kv_cache == "int8":
        record["scales"] = ("per (kv head, channel), from the float64 reference's |K|, |V| max on calibration text "
                            "× 1.25; initializers /model/layers.{layer}/attn/{k|v}_scale")
    return record


def _eos_ids(spec: ModelSpec, model_dir: Path) -> list[int]:
    """config.json's end-of-sequence ids, then generation_config.json's (build() reads them before the export: a
    malformed file failed after all the work, with a traceback)."""
    ids = list(spec.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        config = json_object(gen)
        for e in token_ids(config.get("eos_token_id"), "eos_token_id", gen):
            if e not in ids:
                ids.append(e)
    return ids


def _precision_record(cfg: CompileConfig, attention: str) -> dict:
    """What the precision means on this target, including the session options the graph relies on."""
    p, q = cfg.precision, cfg.quant
    gpu = cfg.target != "cpu"
    record = {"weights": p, "compute": "fp16" if gpu else "fp32", "kv_cache": "fp16" if gpu else cfg.kv_cache,
              "embeddings": q.embeddings, "session_config": {}}
    if cfg.target == "cpu":
        record["kernels"] = cfg.kernels_used      # the runtime registers our ops for "qs"
        record["attention"] = "qs.CausalAttention" if attention == "qs" else "com.microsoft.GroupQueryAttention"
        if cfg.attention_products != "fp32":
            record["attention_products"] = cfg.attention_products
    if cfg.target == "cpu" and p in ("int8", "int4"):
        record["batch_invariant"] = cfg.batch_invariant
    if p == "int8" and not cfg.batch_invariant:
        record.update(scheme="int8 symmetric, per output channel; DynamicQuantizeMatMul (activations uint8, one "
                             "scale per step: not batch-invariant)")
    elif p == "int8":
        record.update(scheme="int8 symmetric (7-bit magnitude), per output channel; activations uint8 per row "
                             "(batch-invariant); " + ("qs.Int8MatMul" if cfg.own_kernels else "MatMulIntegerToFloat"))
    elif p == "int4" and cfg.own_int4:
        scales = ("a float scale per channel times an integer in 1..16 per block" if q.int4_scales == "int"
                  else "fp16 scales")
        record.update(scheme=f"int4 symmetric, block 32 along K, {scales}; activations int8 per row "
                             "(batch-invariant); qs.Int4MatMul", block_size=q.block_size, awq=q.calib is not None,
                      int4_scales=q.int4_scales)
    elif p == "int4":
        record.update(scheme=f"int4 symmetric, block {q.block_size} along K; MatMulNBits accuracy_level 4"
                             + ("; one-row steps padded to two (batch-invariant)" if cfg.batch_invariant else ""),
                      block_size=q.block_size, awq=q.calib is not None)
        if cfg.batch_invariant:       # the runtime drops the pad where this CPU computes one row like many
            record["min_rows"] = MIN_ROWS
    elif p == "fp8":
        record.update(scheme="float8 e4m3fn, per output channel scale, 1 byte per weight")
        if not gpu:
            record.update(cpu_conversion="fp8 → fp32 once at load (DequantizeLinear constant-folded), exact fp8 numerics")
            record["session_config"]["session.disable_quant_qdq"] = "1"
    elif p == "fp16":
        record.update(scheme="fp16 weights and activations" if gpu else "fp16 storage, widened to fp32 at load")
    if cfg.target == "tensorrt" and p in ("int8", "fp8"):
        record.update(scheme=f"{p} weights per output channel as weight-only DequantizeLinear → fp16 MatMul (TensorRT fuses)")
    return record


def _check_head_dim(spec: ModelSpec, cfg: CompileConfig) -> None:
    """The cpu graph's attention is ONNX Runtime's GroupQueryAttention, whose CPU kernel takes only head sizes
    that are multiples of 16: refuse such a model before building, not with a traceback at its first run."""
    if cfg.target == "cpu" and spec.head_dim % 16:
        raise CheckpointError(f"head_dim {spec.head_dim} (hidden_size / num_attention_heads, or config.json's "
                              "head_dim) is not a multiple of 16, which ONNX Runtime's GroupQueryAttention on the "
                              "CPU requires; --target cpu cannot run this model")


QS_HEAD_DIMS = (16, 32, 64, 96, 128)     # what qs.CausalAttention is compiled for (plugins/cpu/attention.cpp)


def _qs_attention_fits(spec: ModelSpec, cfg: CompileConfig) -> bool:
    """Whether qs.CausalAttention can run this graph: our cpu kernels, at a head size ours is compiled for."""
    return cfg.own_kernels and spec.head_dim in QS_HEAD_DIMS


def _resolve_kv_cache(spec: ModelSpec, cfg: CompileConfig) -> str:
    """--kv-cache auto: fp16 where qs.CausalAttention runs a quantized or fp16 cpu engine (a decode step streams
    the whole cache: half the bytes is ~5 % of a batch-1 smollm2 int8 step and ~18 % at batch 8, with half the
    memory per token), else fp32 — an fp32 engine stays the exact reference, GroupQueryAttention has no fp16
    cpu cache, and the GPU targets' paged cache is fp16 by construction."""
    if cfg.kv_cache != "auto":
        return cfg.kv_cache
    return "fp16" if _qs_attention_fits(spec, cfg) and cfg.precision != "fp32" else "fp32"


def _attention_op(spec: ModelSpec, cfg: CompileConfig) -> str:
    """"qs" (qs.CausalAttention) with our kernels over an fp32 or fp16 KV cache at a head size ours is compiled
    for; else "ort" (GroupQueryAttention), which an fp16 cache cannot use."""
    ours = _qs_attention_fits(spec, cfg) and cfg.kv_cache in ("fp32", "fp16")
    if cfg.kv_cache == "fp16" and not ours:
        why = ("this install was built without our cpu ops" if not cfg.own_kernels
               else f"head_dim {spec.head_dim} is not one it is compiled for ({', '.join(map(str, QS_HEAD_DIMS))})")
        raise CheckpointError(f"--kv-cache fp16 needs qs.CausalAttention, and {why}; use --kv-cache fp32")
    if cfg.attention_products == "bf16" and not (ours and cfg.kv_cache == "fp16"):
        raise CheckpointError("--attention-products bf16 is qs.CausalAttention's over an fp16 KV cache, and this "
                              f"engine's cache is {cfg.kv_cache} on {'ours' if ours else 'GroupQueryAttention'}; "
                              "use --kv-cache fp16 (or drop --attention-products)")
    return "qs" if ours else "ort"


def _check_block_size(spec: ModelSpec, cfg: CompileConfig) -> None:
    from .quantize.int4 import check_block_size

    if cfg.precision == "int4":
        for k in (spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim):
            check_block_size(k, cfg.quant.block_size)


def _accuracy(engine_dir: Path, cfg: CompileConfig, log) -> dict:
    """Score the staged engine against an fp32 build of the same checkpoint (itself, if it is fp32)."""
    if cfg.precision == "fp32" and cfg.kv_cache == "fp32":
        return report.measure(engine_dir, None, cfg.quant.eval_file)
    with tempfile.TemporaryDirectory(prefix="qs-baseline-") as tmp:
        log("building the fp32 baseline for the accuracy report")
        base = replace(cfg, out_dir=Path(tmp) / "fp32", precision="fp32", report=False, overwrite=False,
                       quant=QuantConfig(eval_file=cfg.quant.eval_file), kv_cache="fp32", attention_products="fp32")
        build(base, log=lambda _: None)
        return report.measure(engine_dir, base.out_dir, cfg.quant.eval_file)


def _kv_scales(spec: ModelSpec, reader: CheckpointReader, cfg: CompileConfig, tokenizer: Path, log) -> list | None:
    """int8 KV cache: per-channel scales calibrated on the evaluation text past the tokens the report scores."""
    if cfg.kv_cache != "int8":
        return None
    from .quantize import kv_int8

    ids = Tokenizer.from_file(str(tokenizer)).encode(
        Path(cfg.quant.eval_file or report.DEFAULT_EVAL).read_text(encoding="utf-8", errors="replace")).ids
    ids = ids[report.MAX_TOKENS:report.MAX_TOKENS + CALIB_TOKENS] if len(ids) >= report.MAX_TOKENS + 64 else ids[:CALIB_TOKENS]
    log(f"calibrating int8 KV cache scales on {len(ids)} tokens")
    return kv_int8.calibrate(spec, reader, ids)


def build(cfg: CompileConfig, log=print) -> dict:
    """Build the engine described by `cfg`; return its manifest. Raises QuicksilverError on bad input."""
    t0 = time.time()
    check_destination(cfg.out_dir, cfg.overwrite)   # before the work, not only at the swap
    spec = read_spec(cfg.model_dir)
    _check_head_dim(spec, cfg)
    cfg = replace(cfg, kv_cache=_resolve_kv_cache(spec, cfg))
    tok_files = tokenizer_files(cfg.model_dir)
    eos_ids = _eos_ids(spec, cfg.model_dir)         # generation_config.json read before the export
    reader = CheckpointReader(cfg.model_dir)
    reader.check(REGISTRY[spec.architecture](spec, reader).tensor_shapes())
    _check_block_size(spec, cfg)
    if cfg.quant.calib is not None:
        calib = Tokenizer.from_file(str(tok_files[0])).encode(cfg.quant.calib.read_text(errors="replace")).ids
        reader = awq_reader(spec, reader, calib[:CALIB_TOKENS], cfg.quant.block_size, log,
                            int_scales=cfg.int4_int_scales)
    attention = _attention_op(spec, cfg)
    max_len = cfg.max_seq_len or spec.max_position_embeddings
    if max_len > spec.max_position_embeddings:
        raise CheckpointError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                              f"{spec.max_position_embeddings}")
    log(f"building {spec.architecture} ({spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads}/{spec.num_kv_heads} heads) at {cfg.precision} → {cfg.out_dir}")
    with staging_dir(cfg.out_dir, cfg.overwrite) as tmp:
        builder = GraphBuilder(tmp / DATA_FILE)
        try:
            arch = REGISTRY[spec.architecture](spec, reader)
            ctx = Ctx(builder, spec, cfg.precision, cfg.quant.block_size, cfg.quant.embeddings, cfg.target, max_len,
                      _kv_scales(spec, reader, cfg, tok_files[0], log), cfg.batch_invariant, attention=attention,
                      own_kernels=cfg.own_kernels, own_int4=cfg.own_int4, kv_cache=cfg.kv_cache,
                      int4_int_scales=cfg.int4_int_scales,
                      attention_products=cfg.attention_products)
            with tqdm(total=spec.num_layers, desc="export", unit="layer", leave=False) as bar:
                arch.emit(ctx, max_len, progress=bar.update)
        finally:
            builder.save(tmp / GRAPH_FILE)
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)
        plan = None
        if cfg.target == "tensorrt":
            from . import tensorrt_plan

            built = tensorrt_plan.build_plan(tmp / GRAPH_FILE, tmp / tensorrt_plan.PLAN_FILE, cfg.precision, max_len,
                                             spec.num_kv_heads, spec.head_dim, log)
            plan = {"plan": tensorrt_plan.PLAN_FILE if built else None, "plugin": "QsPagedAttention v1",
                    "block_size": tensorrt_plan.BLOCK_SIZE}
        manifest = write_manifest(tmp, _manifest(cfg, spec, reader, builder, tok_files, eos_ids, attention, max_len,
                                                   plan))
        if cfg.report and cfg.target != "cpu":
            log(f"accuracy report skipped for --target cuda: check the engine with `compile verify {cfg.out_dir} "
                "--device cpu` (its forward on PyTorch CPU tensors)" if cfg.target == "cuda" else
                f"accuracy report skipped: a --target {cfg.target} engine runs only under TensorRT")
        elif cfg.report:
            manifest["accuracy"] = _accuracy(tmp, cfg, log)
            log(report.describe(manifest["accuracy"]))
            manifest = write_manifest(tmp, manifest)
    manifest["build_seconds"] = round(time.time() - t0, 2)
    return manifest


def _manifest(cfg: CompileConfig, spec, reader: CheckpointReader, builder: GraphBuilder, tok_files: list[Path],
              eos_ids: list[int], attention: str, max_len: int, plan: dict | None) -> dict:
    """The manifest's records of a built graph (write_manifest adds the format and every file's sha256). An engine
    with int4 integer block scales says format version 2, which readers from before them refuse (their kernels would
    ignore the packing's attribute and, where its size matched the old one, compute garbage)."""
    return {
        **({"format_version": INT_SCALES_FORMAT_VERSION} if cfg.int4_int_scales else {}),
        "compiler_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": cfg.target,
        "precision": _precision_record(cfg, attention),
        "model": {**spec.to_dict(), "max_seq_len": max_len, "num_parameters": reader.num_parameters()},
        "graph": {"file": GRAPH_FILE, "data": DATA_FILE, "opset": OPSET, "revision": GRAPH_REVISION,
                  **builder.interface()},
        "kv_cache": _kv_record(spec, cfg, max_len),
        "tokenizer": {"files": [f.name for f in tok_files], "eos_token_ids": eos_ids,
                      "bos_token_id": spec.bos_token_id},
        "source": {"path": str(cfg.model_dir.resolve()), "fingerprint": fingerprint(cfg.model_dir),
                   "dtypes": sorted(reader.dtypes())},
        **({"tensorrt": plan} if plan is not None else {}),
    }


def summary(manifest: dict, out_dir: Path) -> str:
    m, size = manifest["model"], sum(f["size"] for f in manifest["files"].values())
    return (f"built {out_dir}: {m['architecture']}, {m['num_parameters'] / 1e6:.1f} M parameters, "
            f"{manifest['precision']['weights']} weights, {size / 2**20:.1f} MiB, "
            f"context {m['max_seq_len']}, in {manifest.get('build_seconds', 0):.1f} s")
