"""CompileConfig: the validated options of one `compile build`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PRECISIONS = ("fp32", "fp16", "int8", "int4", "fp8")
TARGETS = ("cpu", "cuda", "tensorrt")
# What each target can compute: the cuda graph runs in fp16 with com.microsoft.PagedAttention (ONNX Runtime's
# CUDA execution provider), where DynamicQuantizeMatMul (int8 on CPU) has no kernel; the tensorrt graph uses
# standard ops + our QsPagedAttention plugin, with int8/fp8 weights as weight-only Q/DQ that TensorRT fuses.
TARGET_PRECISIONS = {"cpu": PRECISIONS, "cuda": ("fp16", "int4", "fp8"), "tensorrt": ("fp16", "fp8", "int8")}
EMBEDDINGS = ("quantized", "int8", "fp32")
KERNELS = ("auto", "qs", "ort")   # cpu: our ops (plugins/cpu) beside ONNX Runtime's, or ONNX Runtime's alone
# cpu KV cache storage: fp32, fp16 (qs.CausalAttention: half the bytes a decode step streams), int8
# (GroupQueryAttention's quantized cache: 4× the tokens per byte); auto: fp16 where our attention op runs a
# quantized or fp16 engine, else fp32 (an fp32 engine stays the exact reference)
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8")
KV_CACHE_NUMPY = {"fp32": "float32", "fp16": "float16", "int8": "int8"}   # each cpu cache's element type
# cpu attention's multiplies over an fp16 cache: fp32, or bf16 pairs with fp32 sums (half the arithmetic a token of
# context costs, at bf16's 8 significant bits)
ATTENTION_PRODUCTS = ("fp32", "bf16")
INT4_SCALES = ("int", "fp16")     # qs.Int4MatMul's block scales: integer multipliers of a channel scale, or fp16


@dataclass(frozen=True)
class QuantConfig:
    block_size: int = 32            # int4: weights per scale along the input dimension
    calib: Path | None = None       # int4: calibration text for the activation-aware (AWQ) scale search
    embeddings: str = "quantized"   # embedding table + LM head: as the weights, or held at "int8" / "fp32"
    eval_file: Path | None = None   # accuracy report text; None: the held-out code text shipped with Quicksilver
    batch_invariant: bool = True    # cpu int8/int4: a row's result never depends on the other rows of its step
    int4_scales: str = "int"        # qs.Int4MatMul: block scales as integer multipliers of a channel's, or fp16

    def __post_init__(self):
        if self.int4_scales not in INT4_SCALES:
            raise ValueError(f"int4 scales must be one of {', '.join(INT4_SCALES)}, not {self.int4_scales!r}")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(f"embeddings must be one of {', '.join(EMBEDDINGS)}, not {self.embeddings!r}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block size must be a power of two ≥ 16, not {self.block_size}")
        for label, path in (("calibration", self.calib), ("evaluation", self.eval_file)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{label} file not found: {path}")


def installed_cpu_ops() -> str | None:
    """The ISA our cpu ops (runtime._native) were built for on this install, or None without them: what
    `--kernels auto` resolves by (the manifest records the choice: precision.kernels and its scheme)."""
    from runtime import cpu_ops

    return cpu_ops.isa() if cpu_ops.available() else None


@dataclass(frozen=True)
class CompileConfig:
    model_dir: Path
    out_dir: Path
    precision: str = "fp32"
    target: str = "cpu"
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    overwrite: bool = False
    quant: QuantConfig = QuantConfig()
    report: bool = True             # measure the accuracy report (perplexity vs the fp32 build)
    kv_cache: str = "auto"          # KV cache storage (cpu): fp32, fp16, int8 (calibrated per-channel scales), auto
    kernels: str = "auto"           # cpu: qs (our ops beside ONNX Runtime's), ort (its alone), auto: qs when built
    attention_products: str = "fp32"  # cpu, fp16 KV cache: attention's multiplies in fp32 or bf16 (qs.CausalAttention)

    @property
    def own_kernels(self) -> bool:
        """Whether the cpu graph uses our `qs` ops (plugins/cpu): qs.CausalAttention for an fp32 KV cache (the
        int8 cache stays on GroupQueryAttention), qs.Int8MatMul for the batch-invariant int8 linears and head, and
        qs.Int4MatMul for int4 where `own_int4`."""
        if self.target != "cpu" or self.kernels == "ort":
            return False
        if self.kernels == "qs":
            return True
        return installed_cpu_ops() is not None

    @property
    def own_int4(self) -> bool:
        """int4 linears as qs.Int4MatMul (blocks of 32) rather than MatMulNBits: with our kernels, where they were
        compiled with AVX-512 (elsewhere qs.Int4MatMul's portable loop is slower than MLAS's AVX2 kernel)."""
        if not (self.own_kernels and self.precision == "int4" and self.quant.block_size == 32):
            return False
        return (installed_cpu_ops() or "").startswith("avx512")

    @property
    def int4_int_scales(self) -> bool:
        """Whether the int4 linears are packed with integer block scales (qs.Int4MatMul int_scales = 1)."""
        return self.own_int4 and self.quant.int4_scales == "int"

    @property
    def kernels_used(self) -> str:
        """What the manifest records as precision.kernels (cpu): "qs" or "ort"."""
        return "qs" if self.own_kernels else "ort"

    @property
    def batch_invariant(self) -> bool:
        """Whether the graph keeps each row's result independent of its batch (a cpu graph's choice; the GPU
        targets' kernels have no per-step scale or one-row special case to hide)."""
        return self.quant.batch_invariant and self.target == "cpu"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, not {self.target!r}")
        if self.precision not in TARGET_PRECISIONS[self.target]:
            raise ValueError(f"--target {self.target} supports --precision {', '.join(TARGET_PRECISIONS[self.target])}, "
                             f"not {self.precision}")
        if self.target == "cuda" and self.quant.embeddings == "int8":
            raise ValueError(f"--embeddings int8 is a CPU format; --target {self.target} keeps the table in fp16")
        if self.max_seq_len is not None and self.max_seq_len < 16:
            raise ValueError(f"max_seq_len must be at least 16, not {self.max_seq_len}")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {self.kernels!r}")
        if self.kernels == "qs" and self.target != "cpu":
            raise ValueError(f"--kernels qs are cpu ops; --target {self.target} has its own kernels")
        if self.kv_cache == "fp16" and self.kernels == "ort":
            raise ValueError("--kv-cache fp16 is read by our attention op (qs.CausalAttention); --kernels ort has "
                             "GroupQueryAttention, whose cpu cache is fp32 or int8")
        if self.kv_cache not in ("fp32", "auto") and self.target != "cpu":
            raise ValueError(f"--kv-cache {self.kv_cache} is a CPU format; --target {self.target} keeps its paged "
                             "cache in fp16")
        if self.attention_products not in ATTENTION_PRODUCTS:
            raise ValueError(f"attention products must be one of {', '.join(ATTENTION_PRODUCTS)}, "
                             f"not {self.attention_products!r}")
        if self.attention_products == "bf16" and (self.target != "cpu" or self.kernels == "ort"
                                                  or self.kv_cache in ("fp32", "int8")):
            raise ValueError("--attention-products bf16 is our cpu attention op's over an fp16 KV cache: it needs "
                             "--target cpu, --kernels qs or auto and --kv-cache fp16 or auto")
        if self.quant.calib is not None and self.precision != "int4":
            raise ValueError("--calib (activation-aware scales) applies to --precision int4 only")
        model, out = Path(self.model_dir).resolve(), Path(self.out_dir).resolve()
        # The swap at the end of a build replaces --out: it must never hold (or be held by) the checkpoint.
        if out == model or model in out.parents:
            raise ValueError(f"--out {self.out_dir} is the checkpoint folder --model {self.model_dir} or inside it; "
                             "write the engine elsewhere")
        if out in model.parents:
            raise ValueError(f"--model {self.model_dir} is inside --out {self.out_dir}; write the engine elsewhere")
