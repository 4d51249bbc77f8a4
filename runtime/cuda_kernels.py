"""ctypes binding of plugins/cuda (libqs_cuda): paged attention, KV append, RMSNorm + residual, rotary.

Takes device arrays from any framework — PyTorch tensors (duck-typed, so the runtime never imports
torch) or anything with `__cuda_array_interface__` (CuPy) — checks shapes and dtypes against each other
here, and leaves value checks to the C side, which refuses before launching anything. A failed call
raises KernelError with the library's message.

Build the library with `pip install . -C cmake.define.QS_BUILD_CUDA=ON` (installed next to this module),
or point QS_CUDA_LIBRARY at a libqs_cuda.so built with CMake.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from pathlib import Path

# qs_dtype / qs_status of plugins/cuda/include/qs_cuda.h
DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "fp8_e4m3": 3}
STATUS = {0: "ok", 1: "invalid argument", 2: "unsupported", 3: "CUDA error"}
PARTITION_TOKENS = 256   # QS_PARTITION_TOKENS

_TORCH = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16",
          "torch.float8_e4m3fn": "fp8_e4m3", "torch.int32": "i32", "torch.int64": "i64", "torch.uint8": "u8"}
_TYPESTR = {"<f4": "f32", "<f2": "f16", "<i4": "i32", "<i8": "i64", "|u1": "u8"}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "fp8_e4m3": 1, "i32": 4, "i64": 8, "u8": 1}


class KernelError(RuntimeError):
    """A kernel call was refused (bad arguments) or failed on the device."""


class KernelsUnavailable(KernelError):
    """libqs_cuda is not built or cannot be loaded."""


@dataclass(frozen=True)
class DeviceArray:
    """What the binding needs to know about a contiguous device array."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str       # f32 | f16 | bf16 | fp8_e4m3 | i32 | i64 | u8

    @classmethod
    def of(cls, x) -> "DeviceArray":
        if isinstance(x, DeviceArray):
            return x
        if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):               # torch.Tensor
            if getattr(x, "device", None) is not None and getattr(x.device, "type", "cuda") != "cuda":
                raise KernelError(f"expected a CUDA tensor, got one on {x.device}")
            if not x.is_contiguous():
                raise KernelError("tensors passed to the kernels must be contiguous")
            dtype = _TORCH.get(str(x.dtype))
            if dtype is None:
                raise KernelError(f"unsupported tensor dtype {x.dtype}")
            return cls(int(x.data_ptr()), tuple(int(d) for d in x.shape), dtype)
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is None:
            raise KernelError(f"{type(x).__name__} is not a device array (no __cuda_array_interface__)")
        if cai.get("strides") is not None:
            raise KernelError("arrays passed to the kernels must be C-contiguous")
        dtype = _TYPESTR.get(cai["typestr"])
        if dtype is None:
            raise KernelError(f"unsupported array typestr {cai['typestr']}")
        return cls(int(cai["data"][0]), tuple(int(d) for d in cai["shape"]), dtype)

    @classmethod
    def optional(cls, x) -> "DeviceArray | None":
        return None if x is None else cls.of(x)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def library_path() -> Path:
    env = os.environ.get("QS_CUDA_LIBRARY")
    return Path(env) if env else Path(__file__).resolve().parent / "libqs_cuda.so"


def _ptr(x: DeviceArray | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.ptr if x is not None else None)


def _stream(stream: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(stream or None)       # 0: the default stream


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise KernelError(message)


class CudaKernels:
    def __init__(self, path: str | Path | None = None):
        path = Path(path) if path is not None else library_path()
        if not path.is_file():
            raise KernelsUnavailable(
                f"CUDA kernels not found at {path}; build them with "
                "`pip install . -C cmake.define.QS_BUILD_CUDA=ON` or set QS_CUDA_LIBRARY")
        try:
            self.lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelsUnavailable(f"cannot load {path}: {e}") from e
        L, vp, i, f, sz = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
        L.qs_last_error.restype = ctypes.c_char_p
        L.qs_device_memory.argtypes = [ctypes.POINTER(sz), ctypes.POINTER(sz)]
        L.qs_device_memory.restype = ctypes.c_int
        L.qs_paged_attention_workspace_size.restype = sz
        L.qs_paged_attention_workspace_size.argtypes = [i, i, i, i]
        L.qs_paged_attention_decode.argtypes = [vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, i, f, vp, vp, i, i, vp, sz, vp]
        L.qs_paged_attention_prefill.argtypes = [vp, vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, i, i, f, vp, vp, i, i, vp, sz, vp]
        L.qs_packed_attention_workspace_size.restype = sz
        L.qs_packed_attention_workspace_size.argtypes = [i, i, i, i, i]
        L.qs_packed_paged_attention.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, i, i, f, i, vp, sz, vp]
        L.qs_kv_append.argtypes = [vp, vp, vp, vp, vp, i, i, i, i, i, vp, vp, vp]
        L.qs_rmsnorm_residual.argtypes = [vp, vp, vp, vp, i, i, f, i, vp]
        L.qs_rotary.argtypes = [vp, vp, vp, vp, vp, i, i, i, i, i, i, vp]
        for name in ("qs_paged_attention_decode", "qs_paged_attention_prefill", "qs_packed_paged_attention", "qs_kv_append",
                     "qs_rmsnorm_residual", "qs_rotary"):
            getattr(L, name).restype = ctypes.c_int

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            message = self.lib.qs_last_error().decode(errors="replace")
            raise KernelError(f"{what}: {STATUS.get(status, status)}: {message}")

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the current CUDA device."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self.lib.qs_device_memory(ctypes.byref(free), ctypes.byref(total)), "device memory")
        return free.value, total.value

    # -- paged attention --------------------------------------------------------------------------
    def workspace_size(self, num_rows: int, num_heads: int, head_dim: int, max_seq_len: int) -> int:
        return int(self.lib.qs_paged_attention_workspace_size(num_rows, num_heads, head_dim, max_seq_len))

    def paged_attention(self, out, query, k_cache, v_cache, block_tables, seq_lens, *, max_seq_len: int,
                        cu_seqlens_q=None, scale: float | None = None, window: int = 0, k_scale=None,
                        v_scale=None, workspace=None, stream: int = 0) -> None:
        """Decode (cu_seqlens_q None: one query row per sequence) or multi-token causal attention.

        out/query [rows, heads, head_dim]; k/v_cache [blocks, block_size, kv_heads, head_dim];
        block_tables int32 [seqs, max_blocks]; seq_lens int32 [seqs] (KV length incl. this step's tokens);
        cu_seqlens_q int32 [seqs + 1]; workspace: any device buffer of workspace_size(...) bytes.
        """
        o, q, kc, vc = (DeviceArray.of(a) for a in (out, query, k_cache, v_cache))
        bt, sl = DeviceArray.of(block_tables), DeviceArray.of(seq_lens)
        cu = DeviceArray.optional(cu_seqlens_q)
        ks = DeviceArray.optional(k_scale)
        vs = DeviceArray.optional(v_scale)
        ws = DeviceArray.optional(workspace)
        _expect(len(q.shape) == 3 and q.shape == o.shape and q.dtype == o.dtype,
                f"query and out must share shape [rows, heads, head_dim] and dtype (got {q.shape} {q.dtype}, {o.shape} {o.dtype})")
        _expect(len(kc.shape) == 4 and kc.shape == vc.shape and kc.dtype == vc.dtype,
                f"k_cache and v_cache must share shape [blocks, block_size, kv_heads, head_dim] and dtype (got {kc.shape}, {vc.shape})")
        rows, heads, head_dim = q.shape
        _, block_size, kv_heads, cache_dim = kc.shape
        _expect(cache_dim == head_dim, f"cache head_dim {cache_dim} != query head_dim {head_dim}")
        _expect(len(bt.shape) == 2 and bt.dtype == "i32", f"block_tables must be int32 [seqs, max_blocks] (got {bt.shape} {bt.dtype})")
        seqs = bt.shape[0]
        _expect(sl.shape == (seqs,) and sl.dtype == "i32", f"seq_lens must be int32 [{seqs}] (got {sl.shape} {sl.dtype})")
        if cu is None:
            _expect(rows == seqs, f"decode takes one query row per sequence: {rows} rows for {seqs} sequences")
        else:
            _expect(cu.shape == (seqs + 1,) and cu.dtype == "i32", f"cu_seqlens_q must be int32 [{seqs + 1}] (got {cu.shape} {cu.dtype})")
        for name, s in (("k_scale", ks), ("v_scale", vs)):
            _expect(s is None or (s.shape in ((1,), ()) and s.dtype == "f32"), f"{name} must be a device float32 [1]")
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        ws_bytes = 0 if ws is None else ws.nbytes
        common = (heads, kv_heads, head_dim, block_size, bt.shape[1], max_seq_len, window, scale, _ptr(ks), _ptr(vs),
                  DTYPES.get(q.dtype, -1), DTYPES.get(kc.dtype, -1), _ptr(ws), ws_bytes,
                  _stream(stream))
        if cu is None:
            status = self.lib.qs_paged_attention_decode(_ptr(o), _ptr(q), _ptr(kc), _ptr(vc), _ptr(bt), _ptr(sl), seqs, *common)
        else:
            status = self.lib.qs_paged_attention_prefill(_ptr(o), _ptr(q), _ptr(kc), _ptr(vc), _ptr(bt), _ptr(sl), _ptr(cu),
                                                         rows, seqs, *common)
        self._check(status, "paged attention")

    def packed_workspace_size(self, num_tokens: int, num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int) -> int:
        return int(self.lib.qs_packed_attention_workspace_size(num_tokens, num_seqs, num_heads, head_dim, max_seq_len))

    def packed_paged_attention(self, out, qkv, k_cache, v_cache, cu_seqlens_q, past_seqlens, block_tables, slot_mapping,
                               cos_cache, sin_cache, *, num_heads: int, max_seq_len: int, scale: float | None = None,
                               window: int = 0, workspace=None, stream: int = 0) -> None:
        """ORT com.microsoft.PagedAttention semantics in one call: packed qkv [tokens, (H + 2·KVH)·D], rotary at
        past + index, K/V written at slot_mapping (int32, -1 skips), causal attention → out [tokens, H·D]."""
        o, x, kc, vc = (DeviceArray.of(a) for a in (out, qkv, k_cache, v_cache))
        cu, past, bt, sm = (DeviceArray.of(a) for a in (cu_seqlens_q, past_seqlens, block_tables, slot_mapping))
        c, s = DeviceArray.of(cos_cache), DeviceArray.of(sin_cache)
        ws = DeviceArray.optional(workspace)
        _expect(len(kc.shape) == 4 and kc.shape == vc.shape and kc.dtype == vc.dtype == x.dtype,
                "caches must share shape [blocks, block_size, kv_heads, head_dim] and qkv's dtype")
        _, block_size, kv_heads, head_dim = kc.shape
        _expect(len(x.shape) == 2 and x.shape[1] == (num_heads + 2 * kv_heads) * head_dim,
                f"qkv must be [tokens, {(num_heads + 2 * kv_heads) * head_dim}]")
        tokens = x.shape[0]
        _expect(o.shape == (tokens, num_heads * head_dim) and o.dtype == x.dtype, f"out must be [{tokens}, {num_heads * head_dim}]")
        seqs = past.shape[0] if past.shape else 0
        for name, a, shape in (("cu_seqlens_q", cu, (seqs + 1,)), ("slot_mapping", sm, (tokens,))):
            _expect(a.shape == shape and a.dtype == "i32", f"{name} must be int32 {list(shape)}")
        _expect(len(bt.shape) == 2 and bt.shape[0] == seqs and bt.dtype == "i32", f"block_tables must be int32 [{seqs}, max_blocks]")
        _expect(c.shape == s.shape and len(c.shape) == 2 and c.shape[1] == head_dim // 2 and c.dtype == x.dtype,
                f"cos/sin caches must be [max_position, {head_dim // 2}] in qkv's dtype")
        ws_bytes = 0 if ws is None else ws.nbytes
        status = self.lib.qs_packed_paged_attention(
            _ptr(o), _ptr(x), _ptr(kc), _ptr(vc), _ptr(cu), _ptr(past), _ptr(bt), _ptr(sm), _ptr(c), _ptr(s), tokens, seqs,
            num_heads, kv_heads, head_dim, block_size, bt.shape[1], max_seq_len, window,
            scale if scale is not None else 1.0 / math.sqrt(head_dim), DTYPES.get(x.dtype, -1), _ptr(ws), ws_bytes,
            _stream(stream))
        self._check(status, "packed paged attention")

    # -- small kernels ----------------------------------------------------------------------------
    def kv_append(self, key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, stream: int = 0) -> None:
        """key/value [tokens, kv_heads, head_dim] → cache slots (int64 [tokens], -1 skips)."""
        k, v, kc, vc, sm = (DeviceArray.of(a) for a in (key, value, k_cache, v_cache, slot_mapping))
        _expect(len(k.shape) == 3 and k.shape == v.shape and k.dtype == v.dtype, "key and value must share shape [tokens, kv_heads, head_dim] and dtype")
        _expect(len(kc.shape) == 4 and kc.shape == vc.shape and kc.shape[2:] == k.shape[1:],
                f"caches [blocks, block_size, kv_heads, head_dim] must match key rows {k.shape[1:]} (got {kc.shape})")
        _expect(sm.shape == (k.shape[0],) and sm.dtype == "i64", f"slot_mapping must be int64 [{k.shape[0]}]")
        ks = DeviceArray.optional(k_scale)
        vs = DeviceArray.optional(v_scale)
        status = self.lib.qs_kv_append(_ptr(k), _ptr(v), _ptr(kc), _ptr(vc), _ptr(sm), k.shape[0], k.shape[1], k.shape[2],
                                       DTYPES.get(k.dtype, -1), DTYPES.get(kc.dtype, -1), _ptr(ks), _ptr(vs),
                                       _stream(stream))
        self._check(status, "kv append")

    def rmsnorm_residual(self, out, residual, x, weight, eps: float, *, stream: int = 0) -> None:
        """residual += x (x may be None); out = rmsnorm(residual) * weight.   [rows, hidden]"""
        o, r, w = DeviceArray.of(out), DeviceArray.of(residual), DeviceArray.of(weight)
        xa = DeviceArray.optional(x)
        _expect(len(r.shape) == 2 and o.shape == r.shape and (xa is None or xa.shape == r.shape), "out, residual and x must share shape [rows, hidden]")
        _expect(w.shape == (r.shape[1],), f"weight must be [{r.shape[1]}]")
        _expect(len({a.dtype for a in (o, r, w) + ((xa,) if xa else ())}) == 1, "all RMSNorm operands must share one dtype")
        status = self.lib.qs_rmsnorm_residual(_ptr(o), _ptr(r), _ptr(xa), _ptr(w), r.shape[0], r.shape[1], eps,
                                              DTYPES.get(r.dtype, -1), _stream(stream))
        self._check(status, "rmsnorm")

    def rotary(self, q, k, positions, cos_cache, sin_cache, *, rotary_dim: int | None = None, stream: int = 0) -> None:
        """In place: q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] or None; cos/sin [max_pos, rot/2]."""
        qa, pos, c, s = DeviceArray.of(q), DeviceArray.of(positions), DeviceArray.of(cos_cache), DeviceArray.of(sin_cache)
        ka = DeviceArray.optional(k)
        _expect(len(qa.shape) == 3, "q must be [tokens, heads, head_dim]")
        tokens, heads, head_dim = qa.shape
        rot = rotary_dim or head_dim
        _expect(ka is None or (len(ka.shape) == 3 and ka.shape[0] == tokens and ka.shape[2] == head_dim and ka.dtype == qa.dtype),
                "k must be [tokens, kv_heads, head_dim] with q's dtype")
        _expect(pos.shape == (tokens,) and pos.dtype == "i32", f"positions must be int32 [{tokens}]")
        _expect(c.shape == s.shape and len(c.shape) == 2 and c.shape[1] == rot // 2 and c.dtype == "f32",
                f"cos/sin caches must be float32 [max_position, {rot // 2}]")
        status = self.lib.qs_rotary(_ptr(qa), _ptr(ka), _ptr(pos), _ptr(c), _ptr(s), tokens, heads,
                                    ka.shape[1] if ka else 0, head_dim, rot, DTYPES.get(qa.dtype, -1),
                                    _stream(stream))
        self._check(status, "rotary")
