"""Where the runtime finds its engines when none is named: the bundled models, built on first use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BUNDLED = {"target": "models/target", "draft": "models/draft"}


def engine_dir(role: str = "target", root: Path | None = None) -> Path:
    """$QUICKSILVER_ENGINE (target) or engines/<role>, built from models/<role> with `compile build` if absent."""
    if role == "target" and os.environ.get("QUICKSILVER_ENGINE"):
        return Path(os.environ["QUICKSILVER_ENGINE"])
    root = root or Path.cwd()
    engine = root / "engines" / role
    if (engine / "manifest.json").is_file():
        return engine
    model = root / BUNDLED[role]
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"no engine given and no bundled model at {model}; pass an ENGINE_DIR "
                                "(build one with `compile build --model HF_DIR --out ENGINE_DIR`)")
    from compile.build import build
    from compile.config import CompileConfig

    print(f"building the bundled {role} engine: {model} → {engine} (once)", file=sys.stderr, flush=True)
    build(CompileConfig(model, engine, "int8", overwrite=True, report=False), log=lambda _: None)
    return engine
