"""`compile`: build, inspect and verify Quicksilver engine artifacts."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click
import numpy as np

from . import __version__
from .config import (ATTENTION_PRODUCTS, EMBEDDINGS, INT4_SCALES, KERNELS, KV_CACHE_DTYPES, PRECISIONS, TARGETS,
                     CompileConfig, QuantConfig)
from .errors import QuicksilverError


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quicksilver compile")
def main() -> None:
    """Compile Hugging Face Llama-family checkpoints into Quicksilver engine artifacts."""


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
              help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json).")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Engine folder to write.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="Weight storage precision (the CPU computes in fp32, the cuda target in fp16).")
@click.option("--target", type=click.Choice(TARGETS), default="cpu", show_default=True,
              help="Execution target: cpu (ONNX Runtime CPU); cuda (fp16 graph with paged attention for "
                   "onnxruntime-gpu; fp16, int4, fp8); tensorrt (standard ops + our QsPagedAttention plugin, "
                   "for TensorRT; fp16, fp8, int8).")
@click.option("--max-model-len", "--max-seq-len", "max_seq_len", type=int, default=None,
              help="Longest context the engine serves [default: the model's max_position_embeddings].")
@click.option("--block-size", type=int, default=32, show_default=True, help="int4: weights per scale along the input dimension.")
@click.option("--int4-scales", type=click.Choice(INT4_SCALES), default="int", show_default=True,
              help="int4 with our kernels: each 32-weight block's scale as an integer multiplier (1-16) of one "
                   "float scale per output channel, so a product sums exactly over the whole input dimension: "
                   "prompts on AMX tiles ~2x faster than with fp16, 5 % fewer bytes a decode step, weights ~5 % "
                   "further from the originals; fp16: one fp16 scale per block (engines built before).")
@click.option("--calib", type=click.Path(path_type=Path), default=None,
              help="int4: calibration text for the activation-aware (AWQ) scale search.")
@click.option("--embeddings", type=click.Choice(EMBEDDINGS), default="quantized", show_default=True,
              help="Embedding table + LM head precision: 'quantized' follows --precision; 'int8'/'fp32' keep them higher.")
@click.option("--kv-cache", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="cpu: KV cache storage. fp16 (our attention op) halves the bytes a decode step reads and the "
                   "memory per token; auto picks it for quantized and fp16 engines with our ops, fp32 otherwise. "
                   "int8 holds 4× the tokens in the same memory at about the same decode speed, but prefills "
                   "1.6-4× slower (ONNX Runtime has no GEMM path for a quantized cache); scales per channel, "
                   "calibrated on the --eval text.")
@click.option("--attention-products", type=click.Choice(ATTENTION_PRODUCTS), default="fp32", show_default=True,
              help="cpu, fp16 KV cache: bf16 multiplies attention's queries, keys, probabilities and values in "
                   "bfloat16 pairs with float32 sums (AVX512-BF16), about half the time a token of context costs a "
                   "decode step, at bf16's 8 significant bits (as llama.cpp's bf16 KV cache); elsewhere the op "
                   "emulates it slowly, so build bf16 engines for hosts that have it.")
@click.option("--kernels", type=click.Choice(KERNELS), default="auto", show_default=True,
              help="cpu: qs uses our ops beside ONNX Runtime's (plugins/cpu: an attention op that reads an fp32 or "
                   "fp16 KV cache 3-4x faster than GroupQueryAttention in decode steps, whole int8 linears, int4 "
                   "ones where the ops were built with AVX-512, and the MLP's SwiGLU); ort: ONNX Runtime's ops "
                   "alone; auto: qs when this install was built with them.")
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True,
              help="cpu int8/int4: every row of a step is computed as if it were alone, so a request's greedy "
                   "output does not depend on server load. Off: int8 uses DynamicQuantizeMatMul (one activation "
                   "scale per step, ~5 % faster) and int4 skips padding one-row steps (~25-40 % faster decode at "
                   "batch 1); for single-stream use.")
@click.option("--eval", "eval_file", type=click.Path(path_type=Path), default=None,
              help="Text for the accuracy report [default: held-out Python code shipped with Quicksilver].")
@click.option("--no-report", is_flag=True, help="Skip the accuracy report (faster builds).")
@click.option("--overwrite", is_flag=True,
              help="Replace --out if it is empty or a Quicksilver engine holding only the files its manifest.json "
                   "lists; other folders (and files) are never replaced.")
def build(model_dir: Path, out_dir: Path, precision: str, target: str, max_seq_len: int | None, block_size: int,
          int4_scales: str, calib: Path | None, embeddings: str, kv_cache: str, attention_products: str, kernels: str, batch_invariant: bool,
          eval_file: Path | None, no_report: bool, overwrite: bool) -> None:
    """Build an engine from a checkpoint: ONNX graph + weights + tokenizer + manifest.

    Example: compile build --model ./SmolLM2-135M --out ./engines/smol --precision fp16
    """
    from .build import build as run_build, summary

    try:
        quant = QuantConfig(block_size, calib, embeddings, eval_file, batch_invariant, int4_scales)
        cfg = CompileConfig(model_dir, out_dir, precision, target, max_seq_len, overwrite, quant, not no_report, kv_cache,
                            kernels, attention_products)
        manifest = run_build(cfg, log=lambda m: click.echo(m, err=True))
    except (QuicksilverError, ValueError) as e:
        fail(str(e))
    click.echo(summary(manifest, out_dir))


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of every file.")
def inspect(engine_dir: Path, as_json: bool, no_verify: bool) -> None:
    """Show an engine's manifest (and check its files)."""
    from artifact import load
    from .quantize import report

    try:
        manifest = load(engine_dir, verify=not no_verify)
    except QuicksilverError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
        return
    m, p, kv = manifest["model"], manifest["precision"], manifest["kv_cache"]
    token_bytes = 2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_dim"] * np.dtype(kv["dtype"]).itemsize
    unmeasured = "not measured (--no-report)" if manifest["target"] == "cpu" else "not measured (needs the GPU provider)"
    size = sum(f["size"] for f in manifest["files"].values())
    rows = [
        ("engine", f"{engine_dir} (format v{manifest['format_version']}, compiler {manifest['compiler_version']}, "
                   f"{manifest['created']})"),
        ("model", f"{m['architecture']}, {m['num_parameters'] / 1e6:.1f} M parameters, {m['num_layers']} layers, "
                  f"hidden {m['hidden_size']}, heads {m['num_heads']}/{m['num_kv_heads']} (head_dim {m['head_dim']}), "
                  f"ffn {m['intermediate_size']}, vocab {m['vocab_size']}"),
        ("rope", f"theta {m['rope_theta']}, scaling {m['rope_scaling'] or 'none'}"
                 + (f", sliding window {m['sliding_window']}" if m.get("sliding_window") else "")),
        ("precision", f"weights {p['weights']}, compute {p['compute']}, KV cache {p['kv_cache']}, "
                      f"embeddings {p.get('embeddings', 'quantized')}"),
        *((("scheme", p["scheme"]),) if "scheme" in p else ()),
        *((("cpu path", p["cpu_conversion"]),) if "cpu_conversion" in p else ()),
        ("target", manifest["target"]),
        *((("kernels", f"{p['kernels']}: attention {p['attention']}"
                       + (f", {p['attention_products']} products" if "attention_products" in p else "")),)
          if "kernels" in p else ()),
        ("context", f"{m['max_seq_len']} tokens"),
        ("kv cache", f"{kv['layout']} {kv['dtype']}, {kv['num_layers']} layers × {kv['num_kv_heads']} heads × "
                     f"{kv['head_dim']}, {token_bytes} bytes/token"),
        ("tokenizer", f"{', '.join(manifest['tokenizer']['files'])}; eos {manifest['tokenizer']['eos_token_ids']}"),
        ("source", f"{manifest['source']['path']} (sha256 {manifest['source']['fingerprint'][:16]}…, "
                   f"{'/'.join(manifest['source']['dtypes'])})"),
        ("accuracy", report.describe(manifest["accuracy"]) if "accuracy" in manifest else unmeasured),
        ("files", f"{len(manifest['files'])} files, {size / 2**20:.1f} MiB"
                  + ("" if no_verify else ", sha256 verified")),
    ]
    for key, value in rows:
        click.echo(f"{key:>10}  {value}")


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--model", "model_dir", default=None, type=click.Path(path_type=Path),
              help="The checkpoint the engine was built from (its fingerprint must be the one the manifest records) "
                   "[default: the source path the manifest records].")
@click.option("--prompt-len", type=click.IntRange(min=1), default=64, show_default=True, help="Random prompt tokens.")
@click.option("--steps", type=click.IntRange(min=0), default=16, show_default=True,
              help="Single-token decode steps after the prompt (prompt + steps must fit the engine's context).")
@click.option("--tolerance", type=float, default=None,
              help="Fail (exit 1) if max |Δlogit| exceeds this [default: 1e-3 fp32, 5e-2 fp16 or an int8 KV cache; "
                   "none when the weights are quantized].")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, show_default="cuda if PyTorch sees a GPU",
              help="Where a --target cuda engine runs (the cuda backend's forward; cpu: on PyTorch CPU tensors).")
def verify(engine_dir: Path, model_dir: Path | None, prompt_len: int, steps: int, tolerance: float | None,
           device: str | None) -> None:
    """Compare the engine's logits with a float64 reference forward pass of the checkpoint.

    \b
    fp32 and fp16 weights pass when max |Δlogit| is within --tolerance and every greedy token agrees.
    Quantized weights flip near-tied choices, so they pass on bounds instead, over all compared positions:
      int8  top-1 agreement ≥ 60 %, relative logit error ≤ 0.35
      int4  top-1 agreement ≥ 50 %, relative logit error ≤ 0.35
      fp8   top-1 agreement ≥ 75 %, relative logit error ≤ 0.10
    (relative error: ‖engine − reference‖ / ‖reference‖, each position's logits centred). Worst seen on the
    bundled models and the test checkpoints: int8 75 % / 0.18, int4 70 % / 0.17, fp8 92 % / 0.044.
    """
    from artifact import load
    from .verify import QUANTIZED_BOUNDS, prompt_ids, source_checkpoint, verify as run_verify

    try:
        manifest = load(engine_dir)
        context = manifest["model"]["max_seq_len"]
        if prompt_len + steps > context:
            fail(f"--prompt-len {prompt_len} + --steps {steps} exceed the engine's context of {context} tokens")
        model_dir = source_checkpoint(manifest, model_dir)
        result = run_verify(engine_dir, model_dir, prompt_ids(manifest["model"]["vocab_size"], prompt_len), steps,
                            device)
    except QuicksilverError as e:
        fail(str(e))
    except Exception as e:      # the reference or the runner tripping over a checkpoint: one line, not a traceback
        first = (str(e).strip().splitlines() or [""])[0]
        fail(f"cannot verify {engine_dir} against {model_dir}: {type(e).__name__}: {first}; check that the "
             "checkpoint's config.json matches its weights")
    weights = manifest["precision"]["weights"]
    tol = {"fp32": 1e-3, "fp16": 5e-2}.get(weights, float("inf"))
    if manifest["kv_cache"]["dtype"] in ("int8", "float16"):
        # The reference reads the same rounded cache, but fp32 and float64 K/V round to different int8 (fp16)
        # steps where they sit on a boundary (one int8 step is ~1 % of a channel's range).
        tol = max(tol, 5e-2)
    tol = tolerance if tolerance is not None else tol
    ok = result.max_abs_diff <= tol
    line = (f"max |Δlogit| {result.max_abs_diff:.3g} (prefill {result.prefill_max_abs_diff:.3g}, decode "
            f"{result.decode_max_abs_diff:.3g}) over {result.tokens} tokens; ")
    if weights in QUANTIZED_BOUNDS:
        min_top1, max_rel = QUANTIZED_BOUNDS[weights]
        ok = ok and result.top1_agreement >= min_top1 and result.relative_error <= max_rel
        line += (f"top-1 agreement {100 * result.top1_agreement:.1f} % (≥ {100 * min_top1:.0f} %), relative logit "
                 f"error {result.relative_error:.3g} (≤ {max_rel:g})" + (f"; tolerance {tol:g}" if tol < float("inf") else ""))
    else:
        ok = ok and result.greedy_match
        line += f"greedy tokens {'identical' if result.greedy_match else 'DIFFER'}; tolerance {tol:g}"
    click.echo(f"{line}: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


def entry() -> None:
    """The `compile` command: main() with SIGTERM ending it as Ctrl-C does, through the finally blocks that remove a
    build's staging folder and its accuracy baseline (killed, a build left both: tens of MB to GBs, never removed)."""
    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    main()
