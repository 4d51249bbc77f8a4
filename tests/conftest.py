"""Shared fixtures: deterministic tiny checkpoints written by compile.synthetic and engines built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from compile import synthetic as make_checkpoint
from compile.build import build
from compile.config import CompileConfig

ROOT = Path(__file__).resolve().parents[1]

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# name → (preset, write_checkpoint kwargs)
CHECKPOINTS = {
    "llama": ("tiny-llama", {}),
    "llama-llama3-rope": ("tiny-llama", {"rope_scaling": LLAMA3_SCALING, "seed": 1}),
    "llama-linear-rope-bf16": ("tiny-llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "dtype": "bf16", "seed": 2}),
    "qwen2": ("tiny-qwen2", {"seed": 3}),
    "qwen2-bf16-sharded": ("tiny-qwen2", {"dtype": "bf16", "shards": 3, "seed": 4}),
    "mistral": ("tiny-mistral", {"seed": 5}),
    "mistral-fp16": ("tiny-mistral", {"dtype": "fp16", "seed": 6}),
    "llama-hd128": ("tiny-llama-hd128", {"seed": 7}),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) → path of a generated HF checkpoint folder (cached for the session)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            preset, kwargs = CHECKPOINTS[name]
            cache[name] = make_checkpoint.write_checkpoint(preset, tmp_path_factory.mktemp("ckpt") / name, **kwargs)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def engine(checkpoint, tmp_path_factory):
    """engine(name, precision, kv_cache) → path of an engine built from checkpoint(name) (cached for the session)."""
    cache: dict[tuple[str, str, str], Path] = {}

    def get(name: str, precision: str = "fp32", kv_cache: str = "auto") -> Path:
        key = (name, precision, kv_cache)
        if key not in cache:
            out = tmp_path_factory.mktemp("engine") / (f"{name}-{precision}" + ("" if kv_cache == "auto" else f"-kv{kv_cache}"))
            build(CompileConfig(checkpoint(name), out, precision, kv_cache=kv_cache), log=lambda _: None)
            cache[key] = out
        return cache[key]

    return get


MODELS = ROOT / "models"


@pytest.fixture(scope="session")
def bundled(tmp_path_factory):
    """The bundled pair (models/target, models/draft) built at int8, once per session: {"target": dir, "draft": dir}."""
    if not (MODELS / "target" / "config.json").is_file():
        pytest.skip("bundled models not present")
    out = tmp_path_factory.mktemp("bundled")
    engines = {}
    for role in ("target", "draft"):
        engines[role] = out / role
        build(CompileConfig(MODELS / role, engines[role], "int8"), log=lambda _: None)
    return engines
