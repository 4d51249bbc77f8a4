"""ModelRunner: one ONNX Runtime session over an engine artifact, run through IOBinding.

KV buffers come from a SlotPool and are bound as both past and present (the graph updates them in
place); logits land in a preallocated buffer. Nothing is copied per step except the small int inputs. The
KV bindings (4 × layers pointers) of a slot range are made once and reused: a step rebinds only its token
ids, lengths and logits rows.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnxruntime as ort

import artifact

from ... import cpu_ops
from artifact.errors import ArtifactError

from ...kv.layout import KVLayout
from ..onnx_session import open_session
from .slots import SlotPool, SlotRange
from .weights import WeightArena

log = logging.getLogger("quicksilver.runner")


def check_same_tokenizer(target: "ModelRunner", draft: "ModelRunner") -> None:
    """Speculation compares token ids, so draft and target must tokenize identically."""
    a, b = target.manifest["files"].get("tokenizer.json"), draft.manifest["files"].get("tokenizer.json")
    if a is None or b is None or a["sha256"] != b["sha256"] or target.vocab_size > draft.vocab_size:
        raise ArtifactError(f"draft engine {draft.engine_dir} does not share the target's tokenizer "
                            f"({target.engine_dir}); speculative decoding needs the same tokenizer.json")


SPIN_US = 2000


def session_options(threads: int | None, config: dict[str, str] | None = None, spin: bool = True) -> ort.SessionOptions:
    """min(2, cores) intra-op threads. `spin`: worker threads spin between ops, and for SPIN_US after a run, then
    sleep — back-to-back engine steps find them awake (b=1 decode ~25 % faster than sleeping between ops), an
    idle engine costs nothing after 2 ms (ORT's default spins ~40 ms after every run, which steals a core from
    the Python side between steps on a 2-core machine)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or min(2, os.cpu_count() or 1)
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        so.add_session_config_entry("session.intra_op.spin_duration_us", str(SPIN_US))
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    for key, value in (config or {}).items():   # what the graph needs, recorded by the compiler
        so.add_session_config_entry(key, value)
    return so


def one_row_matches(model: dict, block_size: int, threads: int | None = None) -> bool:
    """Whether this CPU's 4-bit MatMulNBits (accuracy level 4) computes a row alone bit-identically to the same row
    among others, for every K × N of the engine's linears. MLAS computes one row with a GEMV kernel that rounded
    differently from its multi-row kernel on an AVX2 EPYC and agrees on AVX-512 VNNI Xeons; batch-invariant int4
    graphs pad one-row steps to two unless this probe, run at load on random weights, finds them equal."""
    hidden, heads, kv, hd = model["hidden_size"], model["num_heads"], model["num_kv_heads"], model["head_dim"]
    ffn = model["intermediate_size"]
    shapes = {(hidden, (heads + 2 * kv) * hd), (heads * hd, hidden), (hidden, 2 * ffn), (ffn, hidden),
              (hidden, model["vocab_size"])}
    return _one_row_matches(tuple(sorted(shapes)), block_size, threads)


@functools.lru_cache(maxsize=None)
def _one_row_matches(shapes: tuple[tuple[int, int], ...], block_size: int, threads: int | None) -> bool:
    """The probe itself, once per process for each set of shapes (a target and its draft, every test engine)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    so = session_options(threads, spin=False)
    for k, n in shapes:
        n = min(n, 1024)            # output columns are computed independently; K is what orders the sums
        blocks = (k + block_size - 1) // block_size
        weights = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8), "B"),
                   numpy_helper.from_array(rng.uniform(1e-3, 2e-2, n * blocks).astype(np.float32), "S")]
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=block_size, accuracy_level=4)
        graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], weights)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        x = rng.standard_normal((8, k)).astype(np.float32)
        many = session.run(None, {"A": x})[0]
        if not all(np.array_equal(session.run(None, {"A": x[i:i + 1]})[0][0], many[i]) for i in range(3)):
            return False
    return True


# Dummy rows a batched call may take on to span retained slots (KVCacheManager.decode_fence), in the keys they attend
# to together: each costs one row's attention over what its slot keeps, a split costs a second call's weight reads.
SPAN_KEYS = 4096


def slot_groups(slots: list[int], fenced: set[int], dummies: dict[int, int] | None = None) -> list[list[int]]:
    """Indices into `slots` grouped for batched calls: ascending slots, a new group wherever the range between two
    would span a fenced slot (KVCacheManager.fenced_slots), or retained slots (`dummies`: slot → its dummy row's
    position) whose dummy rows would attend to more than SPAN_KEYS keys together."""
    dummies = dummies or {}
    groups: list[list[int]] = []
    spanned = 0
    for i in sorted(range(len(slots)), key=slots.__getitem__):
        between = range(slots[groups[-1][-1]] + 1, slots[i]) if groups else range(0)
        cost = sum(dummies[s] + 1 for s in between if s in dummies)
        if groups and not any(s in fenced for s in between) and spanned + cost <= SPAN_KEYS:
            groups[-1].append(i)
            spanned += cost
        else:
            groups.append([i])
            spanned = 0
    return groups


ONE_ROW_INDEX = np.zeros(1, np.int64)      # a one-row step's logits row


def feed(io: ort.IOBinding, fed: dict, name: str, value: np.ndarray) -> None:
    """Bind `value` as input `name`: into the array bound last time, where the shape is the same (ONNX Runtime reads
    a bound CPU array where it lies, so the step needs no new binding: ~4 µs an input), else a copy bound anew."""
    bound = fed.get(name)
    if bound is not None and bound.shape == value.shape:
        bound[...] = value
    else:
        fed[name] = bound = np.array(value, copy=True, order="C")
        io.bind_cpu_input(name, bound)


class ModelRunner:
    def __init__(self, engine_dir: str | Path, threads: int | None = None, verify: bool = True, spin: bool = True,
                 huge_pages: bool = True):
        self.engine_dir = Path(engine_dir)
        self.manifest = artifact.load(self.engine_dir, verify=verify)
        target = self.manifest.get("target")
        if target != "cpu":
            from ..paged.runner import select_providers

            select_providers(target)        # says what to install when the backend is missing here
            raise ArtifactError(f"{engine_dir} targets {target!r}: the continuous-batching engine runs cpu engines; "
                                "a cuda engine runs through runtime.backends (the cuda or paged backend: the GPU serving "
                                "loop is not wired yet), or rebuild with --target cpu")
        precision = self.manifest["precision"]
        so = session_options(threads, precision.get("session_config"), spin)
        if precision.get("kernels") == "qs":
            try:
                cpu_ops.register(so)
            except cpu_ops.Unavailable as e:
                raise ArtifactError(f"{engine_dir}: {e}") from None
            if precision.get("attention_products") == "bf16" and not cpu_ops.bf16_products():
                log.warning("%s multiplies attention in bf16 and this CPU (or this install's build) has no AVX512-BF16: "
                            "the op emulates it, several times slower; rebuild the engine without "
                            "--attention-products bf16 for this host", engine_dir)
        # batch-invariant int4: one-row steps are padded to two rows only where this CPU needs it
        self.one_row_padded = False
        if "min_rows" in precision:
            self.one_row_padded = not one_row_matches(self.manifest["model"], precision["block_size"], threads)
            if not self.one_row_padded:
                self._min_rows = ort.OrtValue.ortvalue_from_numpy(np.array([1], np.int64))   # outlives the session
                so.add_initializer(precision["min_rows"], self._min_rows)
        # the weights on huge pages where the kernel offers them (weights.py); the session reads them in place
        self.weights = WeightArena.load(self.engine_dir, self.manifest) if huge_pages else None
        if self.weights is not None:
            self.weights.register(so)
        self.session = open_session(self.engine_dir, self.manifest, so, ["CPUExecutionProvider"])
        self.session.weights = self.weights      # whoever holds the session holds the memory it reads
        artifact.check_unchanged(self.engine_dir, self.manifest)      # the graph and weights opened are the verified
        m = self.manifest["model"]
        self.num_layers, self.vocab_size = m["num_layers"], m["vocab_size"]
        self.kv_heads, self.head_dim, self.max_seq_len = m["num_kv_heads"], m["head_dim"], m["max_seq_len"]
        self.kv_layout = KVLayout.from_manifest(self.manifest["kv_cache"])   # float32, or int8 (--kv-cache int8)
        # Whether verify() may put several sequences' guesses in one call: qs.CausalAttention places each row's
        # tokens by its own seqlens_k (GroupQueryAttention refuses several new tokens on a past in a batch > 1), and
        # a batch-invariant graph gives each row the bits it would get alone (greedy speculation stays plain greedy).
        self.batches_verifications = (precision.get("attention") == "qs.CausalAttention"
                                      and precision.get("batch_invariant") is True)
        # Whether the graph takes packed steps (qs.CausalAttention engines built since it could): sequences of any
        # lengths in any slots of a range share one call (step()); on a batch-invariant graph each token computed
        # as it would be alone (elsewhere as batched decodes are: its linears' activations quantized per step)
        self.packs_steps = "kv_rows" in {i.name for i in self.session.get_inputs()}
        self._logits = np.empty((0, self.vocab_size), np.float32)
        # (pool id, first slot, slots) → (pool, binding, session, fed): each entry holds the session too, because an
        # IOBinding does not keep its session alive, and a binding that outlives its session crashes when freed;
        # `fed` holds the step inputs bound last and the logits buffer's (address, rows) (see execute)
        self._bindings: OrderedDict[tuple[int, int, int], tuple[weakref.ref, ort.IOBinding, ort.InferenceSession,
                                                                dict]] = OrderedDict()
        # the key in _bindings of the last execute() call where it was one token of one slot (decode_one), else None
        self._one_key: tuple[int, int, int] | None = None

    MAX_BINDINGS = 64       # slot ranges whose KV bindings are kept (batches of running sequences recur)

    def _binding(self, pool: SlotPool, slots: SlotRange) -> tuple[ort.IOBinding, dict]:
        """An IOBinding with `pool`'s KV for `slots` bound as past and present, and the inputs it has bound since;
        reused while the pool lives."""
        key = (id(pool), slots.start, slots.count)
        entry = self._bindings.get(key)
        if entry is not None and entry[0]() is pool:
            self._bindings.move_to_end(key)
            return entry[1], entry[3]
        io = self.session.io_binding()
        shape = [slots.count, *pool.slot_shape]
        for i in range(self.num_layers):
            for kind, arrays in (("key", pool.keys), ("value", pool.values)):
                ptr = pool.pointer(arrays[i], slots)
                io.bind_input(f"past_key_values.{i}.{kind}", "cpu", 0, pool.dtype, shape, ptr)
                io.bind_output(f"present.{i}.{kind}", "cpu", 0, pool.dtype, shape, ptr)
        fed: dict = {}
        self._bindings[key] = (weakref.ref(pool), io, self.session, fed)
        if len(self._bindings) > self.MAX_BINDINGS:
            self._bindings.popitem(last=False)
        return io, fed

    def new_pool(self, num_slots: int, capacity: int | None = None, huge_pages: bool = False) -> SlotPool:
        """Slots of `capacity` tokens (default: the model's context); `huge_pages`: long sequences' grow by
        transparent huge pages (slots.py)."""
        return SlotPool(self.num_layers, num_slots, self.kv_heads, capacity or self.max_seq_len, self.head_dim,
                        self.kv_layout.dtype, huge_pages)

    def execute(self, input_ids: np.ndarray, seqlens_k: np.ndarray, logits_indices: np.ndarray,
                pool: SlotPool, slots: SlotRange, query_starts: np.ndarray | None = None,
                kv_rows: np.ndarray | None = None) -> np.ndarray:
        """Run one step and return logits [len(logits_indices), vocab] (a view, valid until the next call).

        Args:
            input_ids: [batch, sequence] int64, right-padded rows (packed: [1, tokens]).
            seqlens_k: [batch] int32, each row's KV length after this step minus one (packed: each sequence's).
            logits_indices: [num_logits] int64 rows of the flattened batch×sequence to project.
            pool, slots: the KV slots of the batch's rows, `slots.count == batch` (packed: a range holding them).
            query_starts, kv_rows: a packed step (packs_steps graphs): int32 [sequences + 1] offsets of each
                sequence's tokens in input_ids and int32 [sequences] its slot's index in `slots`.
        """
        batch = input_ids.shape[0]
        assert input_ids.dtype == np.int64 and input_ids.ndim == 2, input_ids.dtype
        total = int(seqlens_k.max()) + 1
        if kv_rows is None:
            assert seqlens_k.dtype == np.int32 and seqlens_k.shape == (batch,), seqlens_k.shape
            assert slots.count == batch and total <= pool.capacity
            if self.packs_steps:        # padded rows: row b's tokens b·S …, its KV row b
                query_starts = np.arange(batch + 1, dtype=np.int32) * np.int32(input_ids.shape[1])
                kv_rows = np.arange(batch, dtype=np.int32)
        else:
            assert self.packs_steps and seqlens_k.dtype == np.int32 and seqlens_k.shape == kv_rows.shape
            assert int(kv_rows.max()) < slots.count and total <= pool.capacity
        n = len(logits_indices)
        if self._logits.shape[0] < n:
            self._logits = np.empty((max(n, 2 * self._logits.shape[0]), self.vocab_size), np.float32)
        io, fed = self._binding(pool, slots)
        feed(io, fed, "input_ids", input_ids)
        feed(io, fed, "seqlens_k", seqlens_k)
        feed(io, fed, "total_sequence_length", np.array(total, np.int32))
        if kv_rows is not None:
            feed(io, fed, "query_starts", query_starts)
            feed(io, fed, "kv_rows", kv_rows)
        feed(io, fed, "logits_indices", np.asarray(logits_indices, np.int64))
        out = (self._logits.ctypes.data, n)
        if fed.get("logits") != out:
            io.bind_output("logits", "cpu", 0, np.float32, [n, self.vocab_size], out[0])
            fed["logits"] = out
        self.session.run_with_iobinding(io)
        one = (slots.count == 1 and input_ids.shape == (1, 1) and n == 1 and logits_indices[0] == 0
               and kv_rows is not None and kv_rows[0] == 0)
        self._one_key = (id(pool), slots.start, 1) if one else None
        return self._logits[:n]

    def decode_one(self, pool: SlotPool, slot: int, token: int, pos: int) -> np.ndarray:
        """execute() for one token of one sequence (`token` at position `pos` of `slot`): logits [1, vocab], a view
        valid until the next call. Why a path of its own: Python between decode steps runs on caches the step's
        weights have just streamed through, where execute()'s few dozen numpy calls took 0.14-0.17 ms of a 9 ms
        qwen2.5-0.5b step (7.7 µs with warm caches). Where the call before was also one token of this slot, every
        input but the token, its position and the total is bound already, and only those three are written."""
        key = (id(pool), slot, 1)
        entry = self._bindings.get(key) if key == self._one_key else None
        if entry is None or entry[0]() is not pool or not 0 <= pos < pool.capacity:
            return self.execute(np.array([[token]], np.int64), np.array([pos], np.int32), ONE_ROW_INDEX, pool,
                                SlotRange(slot, 1))
        _, io, _, fed = entry
        fed["input_ids"][0, 0] = token
        fed["seqlens_k"][0] = pos
        fed["total_sequence_length"].fill(pos + 1)
        self.session.run_with_iobinding(io)
        return self._logits[:1]

    def decode(self, pool: SlotPool, rows: list[tuple[int, int, int]], fenced: set[int],
               dummies: dict[int, int] | None = None) -> np.ndarray:
        """One new token for each of several sequences, batched by contiguous slot range.

        Args:
            rows: (slot, token id, position) per sequence; the position is the token's index in its sequence.
            fenced: slots a batch must not span (KVCacheManager.fenced_slots); a spanned slot gets a dummy row at
                position 0, whose KV write lands in memory nobody reads,
            dummies: or, for a retained slot (KVCacheManager.decode_fence), at the position given here.
        Returns:
            logits [len(rows), vocab] in the order of `rows` (a fresh array).
        """
        if len(rows) == 1:                  # batch 1 (most steps at low load): one row, no groups to form
            return self.decode_one(pool, *rows[0]).copy()
        out = np.empty((len(rows), self.vocab_size), np.float32)
        dummies = dummies or {}
        for group in slot_groups([r[0] for r in rows], fenced, dummies):
            lo = rows[group[0]][0]
            width = rows[group[-1]][0] - lo + 1
            ids = np.zeros((width, 1), np.int64)
            seqlens = np.array([dummies.get(slot, 0) for slot in range(lo, lo + width)], np.int32)
            for i in group:
                slot, token, pos = rows[i]
                ids[slot - lo, 0], seqlens[slot - lo] = token, pos
            index = np.array([rows[i][0] - lo for i in group], np.int64)
            out[group] = self.execute(ids, seqlens, index, pool, SlotRange(lo, width))
        return out

    def verify(self, pool: SlotPool, rows: list[tuple[int, list[int], int]], fenced: set[int]) -> list[np.ndarray]:
        """Several sequences' tokens in one call per contiguous range of slots (batches_verifications engines):
        rows are (slot, tokens, start). Each row is padded to the longest with copies of its last token, whose KV
        lands past the sequence's end, where a rejected guess's lands too: every later step writes a position
        before it attends to it. A spanned slot's dummy row writes positions 0.. of a slot nobody reads (decode).
        Returns logits [len(tokens), vocab] per row, in the order of `rows` (fresh arrays)."""
        width_tokens = max(len(r[1]) for r in rows)
        assert max(start for _, _, start in rows) + width_tokens <= pool.capacity
        out: list[np.ndarray | None] = [None] * len(rows)
        for group in slot_groups([r[0] for r in rows], fenced):
            lo = rows[group[0]][0]
            width = rows[group[-1]][0] - lo + 1
            ids = np.zeros((width, width_tokens), np.int64)
            seqlens = np.full(width, width_tokens - 1, np.int32)
            index = []
            for i in group:
                slot, tokens, start = rows[i]
                ids[slot - lo, :len(tokens)], ids[slot - lo, len(tokens):] = tokens, tokens[-1]
                seqlens[slot - lo] = start + width_tokens - 1
                index.extend((slot - lo) * width_tokens + np.arange(len(tokens)))
            logits = self.execute(ids, seqlens, np.array(index, np.int64), pool, SlotRange(lo, width))
            at = 0
            for i in group:
                n = len(rows[i][1])
                out[i], at = logits[at:at + n].copy(), at + n
        return out

    def step(self, pool: SlotPool, seqs: list[tuple[int, list[int], int, int]]) -> list[np.ndarray | None]:
        """Several sequences' tokens in one packed call (packs_steps graphs): a step's decodes, prompt chunks and
        verifications with one pass over the weights, where separate calls read every weight again for each (a
        16-token slice beside 7 smollm2 decodes: 20 ms as two calls). Each token's arithmetic is what it would be
        in a call of its own (qs.CausalAttention's rows and the batch-invariant linears), and slots between the
        sequences' are bound but not touched, so nothing needs fencing.

        Args:
            seqs: (slot, tokens, start, num_logits) per sequence: its tokens at positions [start, start + len) and
                the logits of its last num_logits tokens; distinct slots.
        Returns:
            logits [num_logits, vocab] per sequence in the order of `seqs` (fresh arrays; None for 0).
        """
        lo = min(slot for slot, *_ in seqs)
        width = max(slot for slot, *_ in seqs) - lo + 1
        ids = np.fromiter((t for _, tokens, _, _ in seqs for t in tokens), np.int64)[None]
        lengths = np.array([len(tokens) for _, tokens, _, _ in seqs], np.int32)
        starts = np.zeros(len(seqs) + 1, np.int32)
        np.cumsum(lengths, out=starts[1:])
        seqlens = np.array([start for _, _, start, _ in seqs], np.int32) + lengths - 1
        kv_rows = np.array([slot - lo for slot, *_ in seqs], np.int32)
        index = np.concatenate([np.arange(starts[i + 1] - n, starts[i + 1]) for i, (*_, n) in enumerate(seqs)])
        if not index.size:              # no sequence wants logits (prompts' middle chunks): one row, dropped
            index = starts[-1:] - 1
        logits = self.execute(ids, seqlens, index.astype(np.int64), pool, SlotRange(lo, width), starts, kv_rows)
        out: list[np.ndarray | None] = []
        at = 0
        for *_, n in seqs:
            out.append(logits[at:at + n].copy() if n else None)
            at += n
        return out

    def prefill(self, pool: SlotPool, slot: int, tokens: list[int], start: int, all_logits: bool = False) -> np.ndarray:
        """Feed `tokens` at positions [start, start + len) of one sequence; logits of the last (or every) token."""
        n = len(tokens)
        index = np.arange(n) if all_logits else np.array([n - 1])
        return self.execute(np.asarray([tokens], np.int64), np.array([start + n - 1], np.int32), index,
                            pool, SlotRange(slot, 1)).copy()
