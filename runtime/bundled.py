"""CLI glue: where `runtime generate/serve` find their engines when none is named — the bundled models, built with
`compile build` on first use and rebuilt when their checkpoint changes. The one runtime module besides cli.py that
may import the compile stage (tests/unit/test_layering.py); the runtime core only ever loads engine artifacts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BUNDLED = {"target": "models/target", "draft": "models/draft"}
REPO = Path(__file__).resolve().parents[1]      # the checkout, when installed editable (`pip install -e .`)


def bundled_root(role: str = "target") -> Path:
    """The folder holding models/ (and engines/, where they are built): $QUICKSILVER_HOME, else the checkout this
    package runs from (whatever the current folder), else the current folder (a non-editable install run from a
    checkout)."""
    if os.environ.get("QUICKSILVER_HOME"):
        return Path(os.environ["QUICKSILVER_HOME"])
    for root in (REPO, Path.cwd()):
        if (root / BUNDLED[role] / "config.json").is_file():
            return root
    raise FileNotFoundError(f"no engine given and no bundled {role} model: it lives in the repository's "
                            f"{BUNDLED[role]}, which this installation ({REPO}) lacks; pass an ENGINE (build one with "
                            "`compile build --model HF_DIR --out ENGINE`), install the checkout with `pip install -e .`,"
                            " or set QUICKSILVER_HOME to it")


def engine_dir(role: str = "target", root: Path | None = None) -> Path:
    """$QUICKSILVER_ENGINE (target) or <root>/engines/<role>, built from <root>/models/<role> with `compile build`
    when absent, when the checkpoint's fingerprint differs from the one the engine was built from, or when the
    engine's kernels are not the ones a build here would choose (an engine from before our cpu ops), or when it is
    an older graph than this compiler emits (compile.build.GRAPH_REVISION)."""
    if role == "target" and os.environ.get("QUICKSILVER_ENGINE"):
        return Path(os.environ["QUICKSILVER_ENGINE"])
    root = root or bundled_root(role)
    engine, model = root / "engines" / role, root / BUNDLED[role]
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"no engine given and no bundled model at {model}; pass an ENGINE "
                                "(build one with `compile build --model HF_DIR --out ENGINE`)")
    from compile.hf_source import fingerprint

    from compile.build import GRAPH_REVISION, build
    from compile.config import CompileConfig

    cfg = CompileConfig(model, engine, "int8", overwrite=True, report=False)
    built, kernels, revision = _built_from(engine)
    source = fingerprint(model)
    if built == source and kernels == cfg.kernels_used and revision == GRAPH_REVISION:
        return engine
    if built is None:
        why = "once"
    elif built != source:
        why = f"{model} changed since it was built"
    elif kernels != cfg.kernels_used:
        why = f"it was built with {kernels or 'ort'} kernels, this install has {cfg.kernels_used}"
    else:
        why = f"its graph is revision {revision or 1}, this compiler's {GRAPH_REVISION}"
    print(f"building the bundled {role} engine: {model} → {engine} ({why})", file=sys.stderr, flush=True)
    build(cfg, log=lambda _: None)
    return engine


def _built_from(engine: Path) -> tuple[str | None, str | None, int | None]:
    """The source fingerprint, kernels and graph revision an engine's manifest records, or None (no engine, an
    unreadable manifest, or a manifest from before the field)."""
    from artifact import read_manifest
    from artifact.errors import ArtifactError

    try:
        manifest = read_manifest(engine)
        return (manifest["source"]["fingerprint"], manifest["precision"].get("kernels"),
                manifest["graph"].get("revision"))
    except (ArtifactError, KeyError, TypeError, AttributeError):
        return None, None, None
