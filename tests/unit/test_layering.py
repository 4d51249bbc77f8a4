"""The import rules between the two stages, checked on the source (imports inside functions included):

- artifact/ (the engine format both stages share) imports neither stage: compile → artifact ← runtime;
- no runtime module imports `compile`, except the CLI glue that builds the bundled engines (cli.py, bundled.py);
- compile reaches the runtime through at most two import lines (the engine's steps for verify and the accuracy
  report, runtime.stepper; which cpu ops this install has, for --kernels auto);
- nothing in runtime/ imports torch or transformers (the runtime ships without them);
- the servers (runtime/server/) import no `compile` at all;
- only runtime/cluster/ imports Ray (an optional extra: runtime serve --replicas).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPILE_TO_RUNTIME = 2     # import lines, in the whole compile stage
GLUE = {"runtime/cli.py", "runtime/bundled.py"}


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file of this repository."""
    rel = path.relative_to(ROOT) if path.is_absolute() else path
    package = list(rel.parent.parts)
    found = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:               # `from . import artifact`
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def violations(rel: str, source: str | None = None) -> list[str]:
    path = ROOT / rel
    bad = []
    for line, name in imports(path, source):
        top = name.split(".")[0]
        where = f"{rel}:{line} imports {name}"
        if rel.startswith("artifact/") and top in ("compile", "runtime"):
            bad.append(f"{where}: the artifact format imports neither stage")
        elif rel.startswith("runtime/") and top == "compile" and rel not in GLUE:
            bad.append(f"{where}: the runtime core never imports the compile stage")
        elif rel.startswith("runtime/") and top == "torch" and not rel.startswith("runtime/backends/cuda/"):
            bad.append(f"{where}: only the cuda backend imports torch (an optional extra)")
        elif rel.startswith("runtime/") and top == "transformers":
            bad.append(f"{where}: the runtime never imports {top}")
        elif top == "ray" and not rel.startswith("runtime/cluster/"):
            bad.append(f"{where}: only runtime/cluster imports Ray (an optional extra)")
    return bad


def test_the_stages_import_each_other_only_as_the_design_says():
    files = sorted(p.relative_to(ROOT).as_posix() for d in ("runtime", "compile") for p in (ROOT / d).rglob("*.py"))
    assert "runtime/engine.py" in files and "compile/build.py" in files
    bad = [v for f in files for v in violations(f)]
    assert not bad, "\n".join(bad)


def test_the_checker_reports_each_kind_of_violation():
    assert violations("runtime/engine.py", "def f():\n    from compile.build import build\n") == \
        ["runtime/engine.py:2 imports compile.build: the runtime core never imports the compile stage"]
    assert violations("runtime/kv/block_pool.py", "from ...compile import artifact\n") == \
        ["runtime/kv/block_pool.py:1 imports compile: the runtime core never imports the compile stage"]
    assert violations("artifact/__init__.py", "from runtime.kv import manager\nfrom .errors import ArtifactError\n") == \
        ["artifact/__init__.py:1 imports runtime.kv: the artifact format imports neither stage"]
    assert violations("runtime/server/app.py", "import torch\n") == \
        ["runtime/server/app.py:1 imports torch: only the cuda backend imports torch (an optional extra)"]
    assert violations("runtime/backends/cuda/forward.py", "import torch\n") == []
    assert violations("runtime/server/http.py", "def f():\n    import compile.verify\n") == \
        ["runtime/server/http.py:2 imports compile.verify: the runtime core never imports the compile stage"]
    assert violations("runtime/cli.py", "import transformers\n") == \
        ["runtime/cli.py:1 imports transformers: the runtime never imports transformers"]      # not even the glue
    assert violations("runtime/bundled.py", "from compile.build import build\n") == []      # CLI glue may
    assert violations("runtime/server/app.py", "def f():\n    from ray import serve\n") == \
        ["runtime/server/app.py:2 imports ray: only runtime/cluster imports Ray (an optional extra)"]
    assert violations("runtime/cluster/replica.py", "import ray\n") == []
    assert violations("compile/verify.py", "from runtime.stepper import open_stepper\n") == []   # compile → runtime


def test_no_function_in_the_stages_is_over_60_lines():
    """A function that does not fit a screen does more than one thing (#46): runtime/, compile/ and artifact/."""
    long = []
    for d in ("runtime", "compile", "artifact"):
        for p in (ROOT / d).rglob("*.py"):
            if "proto" in p.parts:          # generated gRPC code
                continue
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60:
                    long.append(f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert not long, "\n".join(long)


def test_transports_and_the_cluster_read_no_engine_internals():
    """runtime/server and runtime/cluster know an engine through the engine-client protocol (runtime.engine_client:
    info, tokenizer, grammars, num_waiting, generate, abort), never through its runner, scheduler, config, draft
    or KV blocks (#46) — so an engine on replicas needs no stand-in for them."""
    import re

    chains = re.compile(r"\.runner\b|aengine\.engine\b|engine\.(scheduler|config|draft)\b|kv\.blocks\b")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for d in ("runtime/server", "runtime/cluster")
             for p in (ROOT / d).rglob("*.py") for n, line in enumerate(p.read_text().splitlines(), 1)
             if chains.search(line.split("#")[0])]
    assert not found, "\n".join(found)
