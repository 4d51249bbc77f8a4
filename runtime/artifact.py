"""The engine artifact: a folder with manifest.json, the graph, its weights and the tokenizer.

The manifest is the only contract between compile and runtime. Writing goes to a temporary sibling
folder that is renamed into place at the end, so a failed build leaves nothing behind; reading checks
the format, its version and the sha256 of every file before anything else touches them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import ArtifactError

# The architectures this format describes (the graph builder supports exactly these; compile reads the list here).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
FORMAT = "quicksilver-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# What the stages read from a manifest, by section: field → accepted types (dimensions must also be ≥ 1).
FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "": {"target": str, "compiler_version": str, "created": str, "precision": dict, "model": dict, "graph": dict,
         "kv_cache": dict, "tokenizer": dict, "source": dict},
    "precision": {"weights": str, "compute": str, "kv_cache": str},
    "model": {"architecture": str, "num_layers": int, "hidden_size": int, "num_heads": int, "num_kv_heads": int,
              "head_dim": int, "intermediate_size": int, "vocab_size": int, "max_seq_len": int,
              "num_parameters": int, "rope_theta": (int, float), "rope_scaling": (dict, type(None))},
    "graph": {"file": str, "inputs": dict, "outputs": dict},
    "kv_cache": {"layout": str, "dtype": str, "num_layers": int, "num_kv_heads": int, "head_dim": int,
                 "max_seq_len": int},
    "tokenizer": {"files": list, "eos_token_ids": list},
    "source": {"path": str, "fingerprint": str, "dtypes": list},
}
DIMENSIONS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
              "max_seq_len")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse an `--out` whose replacement could destroy anything but an engine: `--overwrite` replaces only a
    folder holding a manifest (or an empty one), never a file or an arbitrary folder such as `.`."""
    out = Path(out).resolve()
    if not out.exists():
        return
    if not out.is_dir():
        raise ArtifactError(f"--out {out} is a file, not an engine folder")
    if not overwrite:
        raise ArtifactError(f"{out} already exists; pass --overwrite to replace it")
    if not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ArtifactError(f"--out {out} is not a Quicksilver engine (no {MANIFEST}); --overwrite replaces only "
                            "an engine folder, choose a new or empty folder")


@contextmanager
def staging_dir(out: Path, overwrite: bool = False):
    """Yield a temporary folder next to `out`; on success it replaces `out`, on failure it vanishes.

    The old engine is renamed aside before the new one is renamed into place and deleted only after,
    so no failure leaves `out` half-written.
    """
    out = Path(out).resolve()
    check_destination(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise ArtifactError(f"cannot write the engine to {out}: {e.strerror or e}") from None
    old = tmp.with_name(tmp.name + ".old")
    try:
        yield tmp
        check_destination(out, overwrite)   # again: the build took a while
        try:
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
        except OSError as e:
            if old.exists() and not out.exists():
                os.replace(old, out)
            raise ArtifactError(f"cannot write the engine to {out}: {e.strerror or e}") from None
    finally:
        for path in (tmp, old):
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Record size and sha256 of every file in `folder` (unless `manifest` already lists them), write manifest.json."""
    files = manifest.get("files")
    if files is None:
        files = {}
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.name != MANIFEST:
                files[p.relative_to(folder).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(engine_dir: Path) -> dict:
    """Parse manifest.json and check its format and version (cheap; no hashing)."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise ArtifactError(f"engine directory not found: {engine_dir}")
    if not path.is_file():
        raise ArtifactError(f"{engine_dir} is not a Quicksilver engine (no {MANIFEST}); build one with `compile build`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is corrupted: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{engine_dir} is not a Quicksilver engine (manifest format is "
                            f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{engine_dir} has engine format version {manifest.get('format_version')!r}, this "
                            f"Quicksilver reads version {FORMAT_VERSION}; rebuild it with `compile build`")
    if not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise ArtifactError(f"{path} lists no files")
    _check_fields(manifest, path)
    arch = manifest["model"]["architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(f"{engine_dir} holds a {arch!r} model, which this Quicksilver cannot run "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    _check_consistent(manifest, path)
    return manifest


def _check_fields(manifest: dict, path: Path) -> None:
    """Every field of FIELDS is present with its type, so nothing fails later with a KeyError."""
    for section, fields in FIELDS.items():
        record = manifest[section] if section else manifest
        for name, kind in fields.items():
            field = f"{section}.{name}" if section else name
            if name not in record:
                raise ArtifactError(f"{path} is invalid: field {field} is missing; rebuild the engine")
            value = record[name]
            if not isinstance(value, kind) or isinstance(value, bool) or (name in DIMENSIONS and value < 1):
                raise ArtifactError(f"{path} is invalid: field {field} is {value!r}; rebuild the engine")


def _check_consistent(manifest: dict, path: Path) -> None:
    """The model's dimensions agree with the KV cache record and with the graph's declared inputs and outputs."""
    model, kv, graph = manifest["model"], manifest["kv_cache"], manifest["graph"]
    for name in ("num_layers", "num_kv_heads", "head_dim", "max_seq_len"):
        if kv[name] != model[name]:
            raise ArtifactError(f"{path} is invalid: field kv_cache.{name} is {kv[name]} but model.{name} is "
                                f"{model[name]}; rebuild the engine")
    logits = graph["outputs"].get("logits") or {}
    if (logits.get("shape") or [None])[-1] != model["vocab_size"]:
        raise ArtifactError(f"{path} is invalid: graph.outputs.logits has shape {logits.get('shape')}, field "
                            f"model.vocab_size is {model['vocab_size']}; rebuild the engine")
    for kind in ("inputs", "outputs"):
        for name, info in graph[kind].items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if "{layer}" in name and (not shape or shape[-1] != model["head_dim"]
                                      or model["num_kv_heads"] not in shape or info.get("dtype") != kv["dtype"]):
                raise ArtifactError(f"{path} is invalid: graph.{kind}.{name} is {info}, but the fields model.num_kv_heads "
                                    f"{model['num_kv_heads']}, model.head_dim {model['head_dim']} and kv_cache.dtype "
                                    f"{kv['dtype']!r} say otherwise; rebuild the engine")


def check_graph_io(manifest: dict, engine_dir: Path, inputs: list[str], outputs: list[str]) -> None:
    """The graph file's input and output names are the manifest's interface, `{layer}` expanded for every layer
    of model.num_layers; the stage that opens the graph calls this (the manifest itself is not hashed)."""
    layers = range(manifest["model"]["num_layers"])
    for kind, names in (("inputs", inputs), ("outputs", outputs)):
        declared = manifest["graph"][kind]
        want = {n.replace("{layer}", str(i)) for n in declared for i in (layers if "{layer}" in n else [0])}
        if set(names) == want:
            continue
        missing, extra = sorted(want - set(names)), sorted(set(names) - want)
        what = (f"the graph has no {kind[:-1]} {missing[0]}" if missing else
                f"the graph has {kind[:-1]} {extra[0]}, which graph.{kind} does not declare")
        raise ArtifactError(f"{engine_dir}/{MANIFEST} does not match {manifest['graph']['file']}: {what} (field "
                            f"model.num_layers is {len(layers)}); rebuild the engine")


def verify_files(engine_dir: Path, manifest: dict) -> None:
    """Every listed file exists with the recorded size and sha256; raise ArtifactError on the first mismatch."""
    for rel, info in manifest["files"].items():
        path = Path(engine_dir) / rel
        if not path.is_file():
            raise ArtifactError(f"{engine_dir} is incomplete: {rel} is missing; rebuild the engine")
        if path.stat().st_size != info["size"]:
            raise ArtifactError(f"{engine_dir} is corrupted: {rel} has {path.stat().st_size} bytes, "
                                f"manifest says {info['size']} (truncated?); rebuild the engine")
        if sha256_file(path) != info["sha256"]:
            raise ArtifactError(f"{engine_dir} is corrupted: sha256 of {rel} does not match the manifest; "
                                "rebuild the engine")


def load(engine_dir: Path, verify: bool = True) -> dict:
    """Read and (by default) verify an engine; return its manifest."""
    manifest = read_manifest(engine_dir)
    if verify:
        verify_files(engine_dir, manifest)
    return manifest
