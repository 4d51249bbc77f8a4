"""Composite emitters for a Llama-family decoder, each built from ONNX Runtime's fastest CPU ops.

Every emitter takes the shared `Ctx` (builder, model spec, weight storage) and returns the names of its
outputs. Weights arrive in Hugging Face layout ([out, in] for linears) and are stored as the graph needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto

from ..hf_source import ModelSpec
from ..quantize import fp8, int8, int4, kv_int8
from .builder import MS_DOMAIN, QS_DOMAIN, GraphBuilder

STORAGE_DTYPES = {"fp32": np.float32, "fp16": np.float16}
TRT_PLUGIN_DOMAIN = "trt.plugins"


@dataclass
class Ctx:
    b: GraphBuilder
    spec: ModelSpec
    precision: str             # fp32 | fp16 (storage; computed in fp32 on CPU) | int8 | int4 | fp8
    block_size: int = 32       # int4 block size along K
    embeddings: str = "quantized"  # embedding table + LM head: "quantized" (as precision), "int8" or "fp32"
    target: str = "cpu"        # cpu: fp32, GroupQueryAttention | cuda: fp16, PagedAttention | tensorrt: fp16,
                               # standard ops + the QsPagedAttention plugin
    max_seq_len: int = 0       # the engine's context (sizes the TensorRT plugin's workspace)
    kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None  # cpu int8 KV cache: (k, v) scales per layer
    batch_invariant: bool = True  # row-local int8 activation quantization, no one-row MatMulNBits (cpu graphs)
    attention: str = "ort"     # cpu: "qs" (qs.CausalAttention, plugins/cpu) or "ort" (GroupQueryAttention)
    own_kernels: bool = False  # cpu: our qs ops may be used (qs.Int8MatMul in the int8 linears and head)
    own_int4: bool = False     # cpu int4: qs.Int4MatMul for the linears (blocks of 32) instead of MatMulNBits
    int4_int_scales: bool = True  # qs.Int4MatMul's packing: integer block multipliers of a channel scale (or fp16)
    shared: dict[str, str] = field(default_factory=dict)  # values built once per graph (per-row shapes)
    kv_cache: str = "fp32"     # cpu KV cache storage: fp32 | fp16 (qs.CausalAttention) | int8 (GroupQueryAttention)
    attention_products: str = "fp32"  # qs.CausalAttention over an fp16 cache: fp32 or bf16 multiplies

    @property
    def act(self) -> type:
        """The activation (compute) dtype: fp32 on CPU, fp16 on the GPU targets."""
        return np.float32 if self.target == "cpu" else np.float16

    @property
    def act_type(self) -> int:
        return TensorProto.FLOAT if self.target == "cpu" else TensorProto.FLOAT16

    def float_weight(self, name: str, array: np.ndarray) -> str:
        """A small float tensor (norm gain, bias, scale) in the compute dtype."""
        return self.b.weight(name, np.asarray(array, dtype=self.act))

    def stored(self, name: str, array: np.ndarray) -> str:
        """A float weight kept at storage precision; fp16 is widened by a Cast that ORT folds at load."""
        dtype = STORAGE_DTYPES.get(self.precision, np.float32)
        w = self.b.weight(name, np.asarray(array, dtype=dtype))
        if dtype == self.act:
            return w
        return self.b.op("Cast", [w], f"{name}/Cast", to=self.act_type)


def plus_bias(ctx: Ctx, y: str, bias: str, name: str) -> str:
    return ctx.b.op("Add", [y, bias], f"{name}/Add") if bias else y


@dataclass(frozen=True)
class SkipNorm:
    """A residual add and RMS norm (`skip_rms_norm`) left for the linear that reads it: our linear op takes it in as
    its prologue and writes the sum, `residual`, as its second output. Any other reader takes `normed(ctx, it)`,
    the SkipSimplifiedLayerNormalization it stands for."""

    x: str
    skip: str
    gamma: str
    name: str

    @property
    def residual(self) -> str:
        return f"{self.name}/residual"


def linears_fold(ctx: Ctx) -> bool:
    """Whether this graph's linears take in the small ops around them (norm, SwiGLU, bias): always with qs.Int4MatMul
    and qs.Int8MatMul; a test turns it off to build the graph they replace."""
    return ctx.target == "cpu" and ((ctx.precision == "int4" and ctx.own_int4) or
                                    (ctx.precision == "int8" and ctx.own_kernels and ctx.batch_invariant))


def _read_by(ctx: Ctx, x: SkipNorm, reader: str) -> None:
    """Records the one reader of a pending norm: whichever node reads it also produces its residual."""
    first = ctx.shared.setdefault(f"{x.name}/reader", reader)
    assert first == reader, f"{x.name} is read by {first} and {reader}: a pending norm has one reader"


def normed(ctx: Ctx, x: str | SkipNorm) -> str:
    """`x` as a value: a SkipNorm emitted as the SkipSimplifiedLayerNormalization it stands for (once)."""
    if not isinstance(x, SkipNorm):
        return x
    _read_by(ctx, x, "SkipLayerNorm")
    if x.name not in ctx.shared:
        ctx.shared[x.name] = ctx.b.node("SkipSimplifiedLayerNormalization", [x.x, x.skip, x.gamma],
                                        f"{x.name}/SkipLayerNorm", domain=MS_DOMAIN, epsilon=ctx.spec.rms_norm_eps,
                                        outputs=[f"{x.name}/SkipLayerNorm/output_0", "", "", x.residual])[0]
    return ctx.shared[x.name]


def folded_linear(ctx: Ctx, x: str | SkipNorm, w: np.ndarray, bias: str, name: str, swiglu: bool = False) -> str:
    """x @ w ([K, N]) in one qs.Int4MatMul or qs.Int8MatMul with what it folds in (plugins/cpu/prologues.cpp, each
    bitwise the op it replaces): the bias; a pending skip RMS norm (x a SkipNorm: the op also writes its residual)
    or, with `swiglu`, silu(gate) · up of x [..., 2K] as its prologue. At batch 1 every op's dispatch cost more than
    its arithmetic: qwen2.5-0.5b's int4 graph went from 221 nodes to 126."""
    (k, n), (bits, weights) = w.shape, packed_weights(ctx, w, name)
    inputs, outputs, attrs = [x, *weights, bias], None, {}
    if isinstance(x, SkipNorm):
        _read_by(ctx, x, name)
        inputs = [x.x, *weights, bias, x.skip, x.gamma]
        outputs = [f"{name}/Int{bits}MatMul/output_0", x.residual]
        attrs = dict(prologue=2, epsilon=float(ctx.spec.rms_norm_eps))
    elif swiglu:
        attrs = dict(prologue=1)
    while inputs[-1] == "":
        inputs.pop()
    return ctx.b.node(f"Int{bits}MatMul", inputs, f"{name}/Int{bits}MatMul", domain=QS_DOMAIN, outputs=outputs, K=k,
                      N=n, **attrs, **int4_attributes(ctx, bits))[0]


def int4_attributes(ctx: Ctx, bits: int = 4) -> dict:
    """qs.Int4MatMul's and qs.Int4Gather's packing attribute (none for int8, or for fp16 block scales: the default)."""
    return {"int_scales": 1} if bits == 4 and ctx.int4_int_scales else {}


def int4_panels(ctx: Ctx, w: np.ndarray) -> np.ndarray:
    """w [K, N] packed for qs.Int4MatMul as the engine's int4 scales say (compile.quantize.int4)."""
    return int4.pack_panels_int(w) if ctx.int4_int_scales else int4.pack_panels(w)


def packed_weights(ctx: Ctx, w: np.ndarray, name: str) -> tuple[int, list[str]]:
    """Our linear op's weight inputs for w [K, N]: (4, [panels with their block scales]) for qs.Int4MatMul, or
    (8, [panels, channel scales, zero-point sums]) for qs.Int8MatMul."""
    b = ctx.b
    if ctx.precision == "int4":
        return 4, [b.weight(f"{name}.weight_int4_panels", int4_panels(ctx, w))]
    q, scale = int8.quantize(w, levels=int8.WEIGHT_LEVELS)
    packed, zsum = int8.pack_panels(q)
    return 8, [b.weight(f"{name}.weight_int8_panels", packed), b.weight(f"{name}.weight_scale", scale),
               b.weight(f"{name}.weight_zsum", zsum)]


def panel_matmul(ctx: Ctx, x: str, bits: int, weights: list[str], k: int, n: int, name: str,
                 output: str | None = None) -> str:
    """qs.Int8MatMul (weights: panels, channel scales, zero-point sums; compile.quantize.int8.pack_panels) or
    qs.Int4MatMul (weights: panels with their block scales; compile.quantize.int4.pack_panels): x [..., k] → [..., n],
    activations quantized per row inside the op (plugins/cpu): the LM head's, and the linears' where they do not fold
    (`folded_linear`)."""
    return ctx.b.node(f"Int{bits}MatMul", [x, *weights], f"{name}/Int{bits}MatMul", domain=QS_DOMAIN,
                      outputs=[output] if output else None, K=k, N=n, **int4_attributes(ctx, bits))[0]


def linear(ctx: Ctx, x: str | SkipNorm, weight: np.ndarray, bias: np.ndarray | None, name: str,
           swiglu: bool = False) -> str:
    """x @ weight.T (+ bias).   x: [..., in]   weight: [out, in] (HF layout)   → [..., out]

    fp32/fp16: MatMul.  int8: `row_quantized_matmul` (per-channel int8 weight, activations quantized per row,
    so batch-invariant), or the same arithmetic in one qs.Int8MatMul with the weight packed for it where the
    engine uses our kernels.  int4: MatMulNBits (block-wise, accuracy_level 4), or qs.Int4MatMul (blocks of 32,
    activations int8 per row) with our kernels on AVX-512.  Our ops take in the bias, a pending norm (x a
    SkipNorm) or, with `swiglu` (x: gate | up), the MLP's activation: `folded_linear`.  fp8: DequantizeLinear(e4m3,
    per channel) → MatMul, which the runtime folds to fp32 once at load (`session.disable_quant_qdq`).
    """
    b, w = ctx.b, np.asarray(weight, np.float32).T          # [K, N]
    bias_name = ctx.float_weight(f"{name}.bias", bias) if bias is not None else ""
    if linears_fold(ctx):
        return folded_linear(ctx, x, w, bias_name, name, swiglu)
    assert not swiglu, "only our ops compute SwiGLU as a linear's prologue"
    x = normed(ctx, x)
    if ctx.precision == "int8" and ctx.target == "tensorrt":      # weight-only Q/DQ: TensorRT fuses it into the GEMM
        q, scale = int8.quantize(w)
        wq = b.op("DequantizeLinear", [b.weight(f"{name}.weight_int8", q), ctx.float_weight(f"{name}.weight_scale", scale)],
                  f"{name}/DequantizeLinear", axis=1)
        return plus_bias(ctx, b.op("MatMul", [x, wq], f"{name}/MatMul"), bias_name, name)
    if ctx.precision == "int8" and not ctx.batch_invariant:   # one activation scale per step: faster, not invariant
        q, scale = int8.quantize(w)
        ins = [x, b.weight(f"{name}.weight_int8", q), b.weight(f"{name}.weight_scale", scale), "", bias_name]
        return b.op("DynamicQuantizeMatMul", ins, f"{name}/DynamicQuantizeMatMul", domain=MS_DOMAIN)
    if (ctx.precision == "int8" and ctx.own_kernels) or (ctx.precision == "int4" and ctx.own_int4):
        bits, weights = packed_weights(ctx, w, name)       # unfolded: only where a test builds what folding replaces
        return plus_bias(ctx, panel_matmul(ctx, x, bits, weights, *w.shape, name), bias_name, name)
    if ctx.precision == "int8":
        q, scale = int8.quantize(w, levels=int8.WEIGHT_LEVELS)
        return row_quantized_matmul(ctx, x, b.weight(f"{name}.weight_int8", q),
                                    b.weight(f"{name}.weight_scale", scale), w.shape[0], bias_name, name)
    if ctx.precision == "int4":
        packed, scales = int4.quantize(w, ctx.block_size)
        ins = [b.weight(f"{name}.weight_q4", packed), ctx.float_weight(f"{name}.weight_scales", scales), "", "", bias_name]
        return nbits_matmul(ctx, x, ins, w.shape[0], w.shape[1], name)
    if ctx.precision == "fp8":
        q, scale = fp8.quantize(w)
        wq = b.op("DequantizeLinear", [b.weight(f"{name}.weight_fp8", q), ctx.float_weight(f"{name}.weight_scale", scale)],
                  f"{name}/DequantizeLinear", axis=1)
    else:
        wq = ctx.stored(f"{name}.weight", w)
    return plus_bias(ctx, b.op("MatMul", [x, wq], f"{name}/MatMul"), bias_name, name)


def row_quantized_matmul(ctx: Ctx, x: str, weight: str, scale: str, k: int, bias: str, name: str,
                         rows: str = "tokens", output: str | None = None) -> str:
    """x @ W for int8 weights with the activations quantized row by row, so a row's result never depends on
    the other rows of the step (DynamicQuantizeMatMul takes one scale for the whole tensor):

        x ─▶ Abs ─▶ ReduceMax(last axis) ─▶ ·1/127 = s                                    [..., 1]
        x ─▶ QuantizeLinear(s, zero point 128, block = K) ─▶ u8 ─▶ MatMulIntegerToFloat(a_scale = s) ─▶ +bias

    x: [..., K]   weight: [K, N] int8 in ±int8.WEIGHT_LEVELS   scale: [N] per output channel   → [..., N]
    The integer product is exact (7-bit weights cannot saturate MLAS's int16 pair sums; a u8·u8 kernel would be
    exact at 8 bits but measured 15 % slower at batch 1) and the scale is row-local, so every row's result is
    bit-identical whatever else is in the batch. An all-zero row has s = 0 and gives 0.
    The zero-point tensor has the shape of s, the same for every linear over the same `rows` ("tokens":
    [B, S]; "logit_rows": the head's [N]), so it is built once per graph (`ctx.shared`).
    """
    b, n = ctx.b, f"{name}/RowQuant"
    zp = b.const(128, np.uint8)
    amax = b.op("ReduceMax", [b.op("Abs", [x], f"{n}/Abs"), b.const([-1])], f"{n}/ReduceMax", keepdims=1)
    s = b.op("Mul", [amax, b.const(1 / 127, np.float32)], f"{n}/Scale")                          # [..., 1]
    key = f"{rows}/zero_point"
    if key not in ctx.shared:
        ctx.shared[key] = b.op("Expand", [zp, b.op("Shape", [s], f"{n}/Shape")], f"{n}/ZeroPoint")
    xq = b.op("QuantizeLinear", [x, s, ctx.shared[key]], f"{n}/QuantizeLinear", axis=-1, block_size=k)
    # The bias is added apart: with a per-row a_scale, ONNX Runtime scales its bias input by a_scale too.
    y = b.node("MatMulIntegerToFloat", [xq, weight, s, scale, zp], f"{name}/MatMulIntegerToFloat", domain=MS_DOMAIN,
               outputs=[output] if output and not bias else None)[0]
    return b.node("Add", [y, bias], f"{name}/Add", outputs=[output] if output else None)[0] if bias else y


MIN_ROWS = "batch_invariant/min_rows"      # int4 graphs: rows MatMulNBits runs on at least (manifest: precision.min_rows)


def nbits_matmul(ctx: Ctx, x: str, inputs: list[str], k: int, n: int, name: str, rows: str = "tokens",
                 output: str | None = None) -> str:
    """MatMulNBits (4-bit, accuracy_level 4) that never sees a single row, so it is batch-invariant:

        x ─▶ Pad(one zero row if the step has one row) ─▶ MatMulNBits ─▶ Slice(drop it)

    x: [B, S, K] (rows "tokens") or [N, K] ("logit_rows").  MLAS computes one row with a GEMV kernel whose
    rounding differs from its multi-row kernel (every M ≥ 2 agrees bit for bit with every other), so without
    the pad a request's logits would change with the number of rows beside it. The pad amount and the row
    count are built once per graph (`ctx.shared`); with two or more rows the pad adds nothing. Whether the GEMV
    rounds differently depends on the CPU (it did on an AVX2 EPYC; on AVX-512 VNNI Xeons every M agrees), so the
    least row count is the named initializer MIN_ROWS, which the runtime sets to 1 where a probe of this CPU's
    kernels finds one row bit-identical to many (runtime.backends.cpu.runner.one_row_matches).
    """
    b, axis = ctx.b, 1 if rows == "tokens" else 0
    attrs = dict(domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=ctx.block_size, accuracy_level=4)
    if not ctx.batch_invariant:
        return b.node("MatMulNBits", [x] + inputs, f"{name}/MatMulNBits", outputs=[output] if output else None, **attrs)[0]
    if f"{rows}/pads" not in ctx.shared:
        shape = b.op("Shape", [x], f"{name}/PadRows/Shape")
        m = b.op("ReduceProd", [b.op("Slice", [shape, b.const([0]), b.const([axis + 1])], f"{name}/PadRows/Lead")],
                 f"{name}/PadRows/Rows", keepdims=1)                                                 # [1]: B·S or N
        min_rows = b.overridable(MIN_ROWS, [2])      # the runtime sets 1 where this CPU's kernels agree (see below)
        pad = b.op("Max", [b.op("Sub", [min_rows, m], f"{name}/PadRows/Missing"), b.const([0])], f"{name}/PadRows/Pad")
        ends = [b.const([0] * (2 * axis + 2)), pad, b.const([0])]      # [begins..., ends...]: pad the end of `axis`
        ctx.shared[f"{rows}/pads"] = b.op("Concat", ends, f"{name}/PadRows/Pads", axis=0)
        ctx.shared[f"{rows}/length"] = b.op("Slice", [shape, b.const([axis]), b.const([axis + 1])], f"{name}/PadRows/Length")
    padded = b.op("Pad", [x, ctx.shared[f"{rows}/pads"]], f"{name}/PadRows")
    y = b.op("MatMulNBits", [padded] + inputs, f"{name}/MatMulNBits", **attrs)
    return b.node("Slice", [y, b.const([0]), ctx.shared[f"{rows}/length"], b.const([axis])], f"{name}/UnpadRows",
                  outputs=[output] if output else None)[0]


def _rms_norm_standard(ctx: Ctx, x: str, g: str, name: str) -> str:
    """RMSNorm from standard ONNX ops (TensorRT parses no com.microsoft ops), accumulated in fp32 so the
    squares cannot overflow fp16:  Cast ─▶ x·x ─▶ ReduceMean ─▶ +eps ─▶ Sqrt ─▶ x / rms ─▶ Cast ─▶ ·gamma"""
    b = ctx.b
    x32 = b.op("Cast", [x], f"{name}/CastUp", to=TensorProto.FLOAT)
    mean = b.op("ReduceMean", [b.op("Mul", [x32, x32], f"{name}/Square"), b.const([-1])], f"{name}/ReduceMean", keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [mean, b.const(ctx.spec.rms_norm_eps, np.float32)], f"{name}/AddEps")], f"{name}/Sqrt")
    normed = b.op("Cast", [b.op("Div", [x32, rms], f"{name}/Div")], f"{name}/CastDown", to=ctx.act_type)
    return b.op("Mul", [normed, g], f"{name}/Mul")


def rms_norm(ctx: Ctx, x: str, gamma: np.ndarray, name: str) -> str:
    """x / rms(x) * gamma   (SimplifiedLayerNormalization)"""
    g = ctx.float_weight(f"{name}.weight", gamma)
    if ctx.target == "tensorrt":
        return _rms_norm_standard(ctx, x, g, name)
    return ctx.b.node("SimplifiedLayerNormalization", [x, g], f"{name}/SimplifiedLayerNorm",
                      num_outputs=1, axis=-1, epsilon=ctx.spec.rms_norm_eps, stash_type=1)[0]


def skip_rms_norm(ctx: Ctx, x: str, skip: str, gamma: np.ndarray, name: str) -> tuple[str | SkipNorm, str]:
    """Residual add fused with the next norm:

        x ──┐
            Add ──▶ residual (output 3)
        skip┘  └──▶ RMSNorm(gamma) ──▶ normed (output 0)

    Where the linears fold norms in (`linears_fold`), a SkipNorm for the next linear to take in.
    """
    g = ctx.float_weight(f"{name}.weight", gamma)
    if ctx.target == "tensorrt":
        residual = ctx.b.op("Add", [x, skip], f"{name}/SkipAdd")
        return _rms_norm_standard(ctx, residual, g, name), residual
    if linears_fold(ctx):
        pending = SkipNorm(x, skip, g, name)
        return pending, pending.residual
    outs = ctx.b.node("SkipSimplifiedLayerNormalization", [x, skip, g], f"{name}/SkipLayerNorm",
                      num_outputs=4, domain=MS_DOMAIN, epsilon=ctx.spec.rms_norm_eps)
    return outs[0], outs[3]


def attention(ctx: Ctx, x: str, w: dict[str, np.ndarray], layer: int, kv: dict[str, str]) -> str:
    """Self-attention over the KV cache:

        x ─▶ MatMul(Wq|Wk|Wv) (+bias) ─▶ attention (rotary inside, cache updated in place) ─▶ MatMul(Wo)

    One fused QKV projection feeds the attention op packed. cpu: qs.CausalAttention (ours) or GroupQueryAttention
    (ONNX Runtime's; the int8 cache, or --kernels ort) over the shared static
    buffers (past ≡ present), writing the new K/V at each row's `seqlens_k` position. cuda: PagedAttention on
    packed tokens, rotating at past_seqlens + index, writing K/V at `slot_mapping` (-1 skips: prefix-cache
    hits), reading each sequence's blocks through `block_table`. tensorrt: our QsPagedAttention plugin, the
    same semantics with no optional inputs.
    """
    s, name, b = ctx.spec, f"/model/layers.{layer}/attn", ctx.b
    qkv_w = np.concatenate([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]], axis=0)
    qkv_b = None
    if s.attention_bias:
        qkv_b = np.concatenate([w["q_proj.bias"], w["k_proj.bias"], w["v_proj.bias"]])
    qkv = linear(ctx, x, qkv_w, qkv_b, f"{name}/qkv_proj")
    scale = float(s.head_dim ** -0.5)
    attrs = dict(num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, do_rotary=1, rotary_interleaved=0, scale=scale)
    if s.sliding_window:
        attrs["local_window_size"] = int(s.sliding_window)
    paged = ["cumulative_sequence_length", "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping"]
    if ctx.target == "cpu" and ctx.attention == "qs":
        # the same inputs and meaning as GroupQueryAttention below, computed by our kernel (plugins/cpu)
        out = b.node("CausalAttention", [qkv, kv["past_key"], kv["past_value"], "seqlens_k", "total_sequence_length",
                                         "cos_cache", "sin_cache", "query_starts", "kv_rows"],
                     f"{name}/CausalAttention", domain=QS_DOMAIN,
                     outputs=[f"{name}/output", kv["present_key"], kv["present_value"]],
                     num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, scale=scale,
                     local_window_size=int(s.sliding_window or -1),
                     **({"bf16_products": 1} if ctx.attention_products == "bf16" else {}))[0]
    elif ctx.target == "cpu":
        inputs = [qkv, "", "", kv["past_key"], kv["past_value"], "seqlens_k", "total_sequence_length",
                  "cos_cache", "sin_cache"]
        if ctx.kv_scales is not None:     # int8 cache: quantized on write, widened on read, one scale per channel
            inputs += ["", "", ""] + [b.weight(n, a) for n, a in zip(kv_int8.scale_names(layer), ctx.kv_scales[layer])]
            attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        out = b.node("GroupQueryAttention", inputs, f"{name}/GroupQueryAttention", domain=MS_DOMAIN,
                     outputs=[f"{name}/output", kv["present_key"], kv["present_value"]], **attrs)[0]
    elif ctx.target == "tensorrt":
        out = b.node("QsPagedAttention", [qkv, kv["key_cache"], kv["value_cache"]] + paged,
                     f"{name}/QsPagedAttention", domain=TRT_PLUGIN_DOMAIN,
                     outputs=[f"{name}/output", kv["key_cache_out"], kv["value_cache_out"]],
                     num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, head_dim=s.head_dim,
                     max_seq_len=ctx.max_seq_len, scale=scale, local_window_size=int(s.sliding_window or 0))[0]
    else:
        # attention_metadata (host memory): this step's bounds on query and KV lengths, so the op sizes its launch
        # without copying the lengths back from the device (a stream sync per layer) and can be graph-captured.
        inputs = [qkv, "", "", kv["key_cache"], kv["value_cache"]] + paged + ["", "", "", "", "", "attention_metadata"]
        out = b.node("PagedAttention", inputs, f"{name}/PagedAttention", domain=MS_DOMAIN,
                     outputs=[f"{name}/output", kv["key_cache_out"], kv["value_cache_out"]], **attrs)[0]
    return linear(ctx, out, w["o_proj.weight"], None, f"{name}/o_proj")


def mlp(ctx: Ctx, x: str, w: dict[str, np.ndarray], layer: int) -> str:
    """SwiGLU:  x ─▶ MatMul(Wgate|Wup) ─▶ Split ─▶ gate·sigmoid(gate) · up ─▶ MatMul(Wdown); with our cpu ops
    the middle is one qs.SwiGLU (plugins/cpu/swiglu.cpp) instead of four ops, or none where the down projection
    computes it (`folded_linear`)."""
    name, ffn = f"/model/layers.{layer}/mlp", ctx.spec.intermediate_size
    gate_up = linear(ctx, x, np.concatenate([w["gate_proj.weight"], w["up_proj.weight"]], axis=0), None,
                     f"{name}/gate_up_proj")
    if linears_fold(ctx):             # silu(gate) · up computed by the down projection as its prologue
        return linear(ctx, gate_up, w["down_proj.weight"], None, f"{name}/down_proj", swiglu=True)
    if ctx.target == "cpu" and ctx.own_kernels:
        prod = ctx.b.op("SwiGLU", [gate_up], f"{name}/SwiGLU", domain=QS_DOMAIN)
        return linear(ctx, prod, w["down_proj.weight"], None, f"{name}/down_proj")
    gate, up = ctx.b.node("Split", [gate_up, ctx.b.const([ffn, ffn])], f"{name}/Split", num_outputs=2, axis=-1)
    sig = ctx.b.op("Sigmoid", [gate], f"{name}/act/Sigmoid")
    act = ctx.b.op("Mul", [gate, sig], f"{name}/act/Mul")
    prod = ctx.b.op("Mul", [act, up], f"{name}/Mul")
    return linear(ctx, prod, w["down_proj.weight"], None, f"{name}/down_proj")


class Embeddings:
    """The token embedding table and the LM head that may share it (tied), stored once at the chosen precision.

    float (fp32/fp16, or --embeddings fp32): one table; Gather rows for lookup, Gemm(transB) for the head.
    fp8:  one e4m3 table with per-token scales, dequantized once at load, then as float.
    int8: one int8 table stored transposed [H, V] with per-token scales: the head is `row_quantized_matmul`,
          the lookup gathers columns (H strided reads per token: cheap) and transposes back. With our kernels
          the table is packed for qs.Int8MatMul (the head) and qs.PackedGather reads its rows (the lookup).
    int4 with qs.Int4MatMul: one table packed for it (the head), read by qs.Int4Gather (the lookup).
    int4: one table in MatMulNBits layout [V, H/bs, bs/2] with block scales: the head is MatMulNBits, the
          lookup gathers packed rows and unpacks nibbles in the graph.
    An untied head gets its own table of the same kind; the embedding table is then lookup-only.
    """

    def __init__(self, ctx: Ctx, table: np.ndarray, name: str = "model.embed_tokens"):
        self.ctx, self.name, b = ctx, name, ctx.b
        table = np.asarray(table, np.float32)                     # [V, H]
        self.vocab, self.hidden = table.shape
        mode = ctx.embeddings if ctx.embeddings != "quantized" else ctx.precision
        self.mode = "float" if mode in ("fp32", "fp16") else mode
        if self.mode == "float":
            self.table = ctx.stored(f"{name}.weight", table) if ctx.embeddings == "quantized" \
                else b.weight(f"{name}.weight", table.astype(ctx.act))
        elif self.mode == "fp8" or (self.mode == "int8" and ctx.target == "tensorrt"):
            # one 8-bit table with per-token scales, dequantized as a whole (fp8 anywhere, int8 for TensorRT)
            q, scale = (fp8 if self.mode == "fp8" else int8).quantize(table, axis=1)
            self.table = b.op("DequantizeLinear", [b.weight(f"{name}.weight_{self.mode}", q), ctx.float_weight(f"{name}.weight_scale", scale)],
                              f"/{name}/DequantizeLinear", axis=0)
            self.mode = "float"
        elif self.mode == "int8":
            q, scale = int8.quantize(table, axis=1, levels=int8.WEIGHT_LEVELS if ctx.batch_invariant else 127)
            self.scale = b.weight(f"{name}.weight_scale", scale)
            if ctx.own_kernels and ctx.batch_invariant:   # one table packed for qs.Int8MatMul, read by qs.PackedGather
                self.mode = "int8-panels"
                panels, zsum = int8.pack_panels(np.ascontiguousarray(q.T))
                self.table = b.weight(f"{name}.weight_int8_panels", panels)
                self.zsum = b.weight(f"{name}.weight_zsum", zsum)
            else:
                self.table = b.weight(f"{name}.weight_int8_t", np.ascontiguousarray(q.T))   # [H, V]
        elif ctx.own_int4:          # one table packed for qs.Int4MatMul (the head), read by qs.Int4Gather
            self.mode = "int4-panels"
            self.table = b.weight(f"{name}.weight_int4_panels", int4_panels(ctx, np.ascontiguousarray(table.T)))
        else:
            packed, scales = int4.quantize(table.T, ctx.block_size)  # [V, H/bs, bs/2], [V*H/bs]
            self.table = b.weight(f"{name}.weight_q4", packed)
            self.scale = ctx.float_weight(f"{name}.weight_scales", scales)
            self.blocks = packed.shape[1]

    def lookup(self, ids: str) -> str:
        """ids [B, S] → embeddings [B, S, H] float."""
        b, n = self.ctx.b, "/model/embed_tokens"
        if self.mode == "float":
            return b.op("Gather", [self.table, ids], f"{n}/Gather", axis=0)
        if self.mode == "int4-panels":
            return b.op("Int4Gather", [ids, self.table], f"{n}/Int4Gather", domain=QS_DOMAIN, K=self.hidden, N=self.vocab,
                        **int4_attributes(self.ctx))
        if self.mode == "int8-panels":
            return b.op("PackedGather", [ids, self.table, self.scale], f"{n}/PackedGather", domain=QS_DOMAIN,
                        K=self.hidden)
        if self.mode == "int8":
            cols = b.op("Gather", [self.table, ids], f"{n}/Gather", axis=1)                     # [H, B, S]
            rows = b.op("Transpose", [cols], f"{n}/Transpose", perm=[1, 2, 0])                 # [B, S, H]
            scale = b.op("Gather", [self.scale, ids], f"{n}/GatherScale", axis=0)              # [B, S]
            scale = b.op("Unsqueeze", [scale, b.const([-1])], f"{n}/Unsqueeze")
            return b.op("Mul", [b.op("Cast", [rows], f"{n}/Cast", to=TensorProto.FLOAT), scale], f"{n}/Mul")
        bs = self.ctx.block_size
        packed = b.op("Gather", [self.table, ids], f"{n}/Gather", axis=0)                     # [B, S, nb, bs/2]
        low = b.op("BitwiseAnd", [packed, b.const(15, np.uint8)], f"{n}/LowNibble")
        high = b.op("BitShift", [packed, b.const(4, np.uint8)], f"{n}/HighNibble", direction="RIGHT")
        pairs = b.op("Concat", [b.op("Unsqueeze", [low, b.const([-1])], f"{n}/UnsqueezeLow"),
                                b.op("Unsqueeze", [high, b.const([-1])], f"{n}/UnsqueezeHigh")], f"{n}/Concat", axis=-1)
        q = b.op("Reshape", [pairs, b.const([0, 0, self.blocks, bs])], f"{n}/ReshapeBlocks")    # [B, S, nb, bs]
        centered = b.op("Sub", [b.op("Cast", [q], f"{n}/Cast", to=self.ctx.act_type), b.const(8.0, self.ctx.act)], f"{n}/Sub")
        scales = b.op("Reshape", [self.scale, b.const([self.vocab, self.blocks, 1])], f"{n}/ReshapeScales")
        scale = b.op("Gather", [scales, ids], f"{n}/GatherScale", axis=0)                      # [B, S, nb, 1]
        return b.op("Reshape", [b.op("Mul", [centered, scale], f"{n}/Mul"), b.const([0, 0, self.hidden])], f"{n}/Reshape")

    def head(self, rows: str, weight: np.ndarray | None) -> str:
        """rows [N, H] → logits [N, V] with this table (tied) or with an untied `weight` [V, H]."""
        if weight is not None:
            return Embeddings(self.ctx, weight, "lm_head").head(rows, None)
        b = self.ctx.b
        out = ["logits"] if self.ctx.act == np.float32 else ["/lm_head/logits_act"]
        if self.mode == "float":
            y = b.node("Gemm", [rows, self.table], "/lm_head/Gemm", outputs=out, transB=1)[0]
        elif self.mode == "int4-panels":
            y = panel_matmul(self.ctx, rows, 4, [self.table], self.hidden, self.vocab, "/lm_head", out[0])
        elif self.mode == "int8-panels":
            y = panel_matmul(self.ctx, rows, 8, [self.table, self.scale, self.zsum], self.hidden, self.vocab, "/lm_head",
                             out[0])
        elif self.mode == "int8":
            if self.ctx.batch_invariant:
                y = row_quantized_matmul(self.ctx, rows, self.table, self.scale, self.hidden, "", "/lm_head",
                                         "logit_rows", out[0])
            else:
                y = b.node("DynamicQuantizeMatMul", [rows, self.table, self.scale], "/lm_head/DynamicQuantizeMatMul",
                           domain=MS_DOMAIN, outputs=out)[0]
        else:
            y = nbits_matmul(self.ctx, rows, [self.table, self.scale], self.hidden, self.vocab, "/lm_head",
                             "logit_rows", out[0])
        if y == "logits":
            return y
        return b.node("Cast", [y], "/lm_head/Cast", outputs=["logits"], to=TensorProto.FLOAT)[0]


def lm_head(ctx: Ctx, hidden: str | SkipNorm, embeddings: Embeddings, weight: np.ndarray | None) -> str:
    """Logits only where the runtime asks (`logits_indices` into the flattened batch×sequence tokens):

        hidden [B,S,H] ─▶ Reshape [B·S,H] ─▶ Gather(logits_indices) ─▶ head ─▶ logits [N,V]

    Prefill asks for one row per sequence, decode for every row, verification for γ+1 per sequence,
    so the vocabulary projection is never computed for tokens nobody reads.
    """
    flat = ctx.b.op("Reshape", [normed(ctx, hidden), ctx.b.const([-1, ctx.spec.hidden_size])], "/lm_head/Reshape")
    rows = ctx.b.op("Gather", [flat, "logits_indices"], "/lm_head/Gather", axis=0)
    return embeddings.head(rows, weight)
