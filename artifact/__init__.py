"""The engine artifact: a folder with manifest.json, the graph, its weights and the tokenizer.

The manifest is the only contract between compile and runtime, and this package is its one definition: both
stages import it, it imports neither (compile → artifact ← runtime). Writing goes to a temporary sibling
folder that is renamed into place at the end, so a failed build leaves nothing behind; reading checks
the format, its version and the sha256 of every file before anything else touches them. Every file a stage
opens in an engine goes through `path` (or `graph_path`): a relative path the manifest lists, inside the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from .errors import ArtifactError

# The architectures this format describes (the graph builder supports exactly these; compile reads the list here).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
FORMAT = "quicksilver-engine"
FORMAT_VERSION = 1
# Version 2: the same layout, written only for engines a version-1 reader would misread rather than refuse — int4
# linears packed with integer block scales (qs.Int4MatMul int_scales = 1), an attribute older kernels ignore. This
# reader reads both.
INT_SCALES_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
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
# The KV cache element types the runtime allocates (numpy names): cpu caches and the cuda target's paged one.
KV_DTYPES = ("float32", "float16", "int8")
# Files the runtime opens by name (tokenizer, chat template, sampling defaults): present, they must be listed.
NAMED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
DIMENSIONS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
              "max_seq_len")


def sha256_file(path: Path, stamps: dict | None = None, key: str | None = None) -> str:
    """The file's sha256; with `stamps`, also records under `key` the identity of the file that was hashed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if stamps is not None:
            stamps[key] = _stamp(os.fstat(f.fileno()))
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _stamp(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Manifest(dict):
    """A manifest as read_manifest returns it: the record (a dict), and `stamps`, the identity (device, inode, size,
    modification time) of manifest.json and of each file verify_files hashed, as they were read: check_unchanged
    compares them with what the paths name once a loader has opened everything."""

    stamps: dict[str, tuple]


def check_unchanged(engine_dir: Path, manifest: dict) -> None:
    """The files read and verified are still the ones at their paths, or ArtifactError. A loader verifies, then
    opens the graph, weights and tokenizer by path; a `compile build --overwrite` of the same folder in between
    (it swaps the folder) left a runner holding one build's manifest and the other's graph, with no error."""
    for rel, stamp in getattr(manifest, "stamps", {}).items():
        try:
            now = _stamp(os.stat(Path(engine_dir) / rel))
        except OSError:
            now = None
        if now != stamp:
            raise ArtifactError(f"{engine_dir} changed while it was being loaded ({rel} is another file now: "
                                "rebuilt?); load it again")


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse an `--out` whose replacement could destroy anything but an engine: `--overwrite` replaces only an
    empty folder or one of our engines that holds nothing its manifest does not list."""
    out = Path(out).resolve()
    _restore_interrupted_swap(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ArtifactError(f"--out {out} is a file, not an engine folder")
    if not overwrite:
        raise ArtifactError(f"{out} already exists; pass --overwrite to replace it")
    if any(out.iterdir()):
        _check_replaceable(out)


def _check_replaceable(out: Path) -> None:
    """`out` holds a manifest of this format and version, and nothing else it does not list."""
    choose = "--overwrite replaces only an engine folder, choose a new or empty folder"
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"--out {out} is not a Quicksilver engine (no {MANIFEST}); {choose}") from None
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        manifest = {}
    fmt, version = manifest.get("format"), manifest.get("format_version")
    if fmt != FORMAT or version not in READABLE_FORMAT_VERSIONS or not isinstance(manifest.get("files"), dict):
        raise ArtifactError(f"--out {out} is not a Quicksilver engine (its {MANIFEST} has format {fmt!r}, format "
                            f"version {version!r}; ours is {FORMAT!r} version {FORMAT_VERSION}); {choose}")
    unknown = _unlisted(out, manifest["files"])
    if unknown:
        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise ArtifactError(f"--out {out} holds files its {MANIFEST} does not list ({shown}); move them out "
                            "first, or choose another folder")


def _unlisted(out: Path, files: dict) -> list[str]:
    """What `out` holds besides manifest.json, the listed files and the folders holding them (a folder as `name/`,
    not descended into; links are never followed)."""
    keep = {MANIFEST, *files}
    parents = {p.as_posix() for rel in files for p in PurePosixPath(rel).parents}
    unknown = []
    for folder, dirs, names in os.walk(out):
        base = PurePosixPath(Path(folder).relative_to(out).as_posix())
        for d in sorted(dirs):
            rel = (base / d).as_posix()
            if rel not in keep and (rel not in parents or (Path(folder) / d).is_symlink()):
                unknown.append(rel + "/")
                dirs.remove(d)
        unknown += [(base / n).as_posix() for n in names if (base / n).as_posix() not in keep]
    return sorted(unknown)


def _restore_interrupted_swap(out: Path) -> None:
    """A build killed between staging_dir's two renames left the old engine renamed aside (.NAME.partial-*.old) and
    no `out`: put it back before anything looks at `out`, so the engine is not lost from sight."""
    if out.exists() or out.is_symlink():
        return
    aside = sorted(out.parent.glob(f".{out.name}.partial-*.old"), key=lambda p: p.stat().st_mtime)
    if aside and aside[-1].is_dir() and not aside[-1].is_symlink():
        os.replace(aside[-1], out)


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it, which other threads would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


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
        tmp.chmod(0o777 & ~_umask())      # a folder as mkdir makes it (mkdtemp's 0700 kept other accounts out)
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
    """Parse manifest.json and check its format, version, fields and file paths (cheap; no hashing)."""
    engine_dir = Path(engine_dir)
    manifest_file = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise ArtifactError(f"engine directory not found: {engine_dir}")
    if not manifest_file.is_file():
        raise ArtifactError(f"{engine_dir} is not a Quicksilver engine (no {MANIFEST}); build one with `compile build`")
    try:
        with open(manifest_file, "rb") as f:
            stamp = _stamp(os.fstat(f.fileno()))
            manifest = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{manifest_file} is corrupted: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{engine_dir} is not a Quicksilver engine (manifest format is "
                            f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise ArtifactError(f"{engine_dir} has engine format version {manifest.get('format_version')!r}, this "
                            f"Quicksilver reads versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))}; rebuild it "
                            "with this install's `compile build`, or upgrade Quicksilver")
    if not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise ArtifactError(f"{manifest_file} lists no files")
    _check_fields(manifest, manifest_file)
    arch = manifest["model"]["architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(f"{engine_dir} holds a {arch!r} model, which this Quicksilver cannot run "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    _check_consistent(manifest, manifest_file)
    _check_paths(manifest, engine_dir)
    manifest = Manifest(manifest)
    manifest.stamps = {MANIFEST: stamp}
    return manifest


def path(engine_dir: Path, manifest: dict, rel: str) -> Path:
    """The resolved path of `rel`, which must be a file the manifest lists, inside `engine_dir` after symlinks.

    Raises:
        ArtifactError: `rel` is not listed, or escapes the folder.
    """
    if not isinstance(rel, str) or rel not in manifest["files"]:
        raise ArtifactError(f"{engine_dir}: {rel} is not a file the manifest lists; rebuild the engine")
    return _resolve(Path(engine_dir), rel)


def graph_path(engine_dir: Path, manifest: dict) -> Path:
    """graph.file, resolved, once every external-data file its tensors name is a listed file too."""
    graph = path(engine_dir, manifest, manifest["graph"]["file"])
    for location in _external_locations(graph, engine_dir):
        data_path(engine_dir, manifest, graph, location)
    return graph


def data_path(engine_dir: Path, manifest: dict, graph: Path, location: str) -> Path:
    """An external-data `location` of the resolved `graph` (ONNX Runtime reads it relative to the graph's folder),
    as the resolved path of a listed file."""
    folder = graph.parent.relative_to(Path(engine_dir).resolve()).as_posix()
    rel = PurePosixPath(folder, location).as_posix()
    if rel not in manifest["files"] or ".." in PurePosixPath(location).parts:
        raise ArtifactError(f"{engine_dir}: the graph's external data {location} is not a file the manifest lists; "
                            "rebuild the engine")
    return path(engine_dir, manifest, rel)


def _resolve(engine_dir: Path, rel: str) -> Path:
    """`engine_dir / rel` after symlinks, if `rel` is a plain relative path that stays inside the folder."""
    root = engine_dir.resolve()
    pure = PurePosixPath(rel)
    resolved = None
    if rel and "\0" not in rel and not pure.is_absolute() and ".." not in pure.parts and pure.as_posix() == rel:
        try:
            resolved = (root / rel).resolve()
        except (OSError, RuntimeError):         # a symlink loop
            pass
    if resolved is None or resolved == root or not resolved.is_relative_to(root):
        raise ArtifactError(f"{engine_dir}: the manifest lists {rel!r}, which is outside the engine folder (files "
                            "must be relative paths inside it); rebuild the engine")
    return resolved


def _external_locations(graph: Path, engine_dir: Path) -> set[str]:
    """The external-data locations named by the graph's tensors: initializers, attributes, subgraphs, functions."""
    import onnx

    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as e:                      # protobuf's DecodeError, OSError
        raise ArtifactError(f"{engine_dir}: {graph.name} is not a readable ONNX graph ({e}); rebuild the "
                            "engine") from None
    graphs, tensors = [model.graph, *model.functions], []
    while graphs:
        g = graphs.pop()
        tensors += getattr(g, "initializer", [])
        tensors += [t for s in getattr(g, "sparse_initializer", []) for t in (s.values, s.indices)]
        for a in (a for node in g.node for a in node.attribute):
            sparse = [a.sparse_tensor, *a.sparse_tensors]
            tensors += [a.t, *a.tensors, *(t for s in sparse for t in (s.values, s.indices))]
            graphs += [a.g, *a.graphs] if a.HasField("g") or a.graphs else []
    return {e.value for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}


def _check_paths(manifest: dict, engine_dir: Path) -> None:
    """Listed files are relative paths inside the folder; the graph and tokenizer are listed files; nothing in
    the folder links outside it, and a file the runtime opens by name is listed."""
    for rel, info in manifest["files"].items():
        _resolve(engine_dir, rel)
        if not (isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)):
            raise ArtifactError(f"{engine_dir}: the manifest records no size and sha256 for {rel}; rebuild the engine")
    if manifest["graph"]["file"] not in manifest["files"]:
        raise ArtifactError(f"{engine_dir}: graph.file {manifest['graph']['file']!r} is not a file the manifest "
                            "lists; rebuild the engine")
    for rel in manifest["tokenizer"]["files"]:
        if rel not in manifest["files"]:
            raise ArtifactError(f"{engine_dir}: tokenizer.files names {rel!r}, which is not a file the manifest "
                                "lists; rebuild the engine")
    root = Path(engine_dir).resolve()
    for name in NAMED_FILES:
        if name not in manifest["files"] and os.path.lexists(root / name):
            raise ArtifactError(f"{engine_dir}: {name} is not listed in the manifest but the runtime reads it; "
                                "remove it or rebuild the engine")
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            link = Path(folder) / name
            if link.is_symlink() and not _points_inside(link, root):
                raise ArtifactError(f"{engine_dir}: {link.relative_to(root)} links to {os.readlink(link)}, "
                                    "outside the engine folder; remove it or rebuild the engine")


def _points_inside(link: Path, root: Path) -> bool:
    try:
        return link.resolve().is_relative_to(root)
    except (OSError, RuntimeError):             # a symlink loop
        return False


def _check_fields(manifest: dict, path: Path) -> None:
    """Every field of FIELDS is present with its type, and what lies inside the lists and records the stages read
    has its type too, so nothing fails later with a KeyError or a TypeError."""
    for section, fields in FIELDS.items():
        record = manifest[section] if section else manifest
        for name, kind in fields.items():
            field = f"{section}.{name}" if section else name
            if name not in record:
                raise ArtifactError(f"{path} is invalid: field {field} is missing; rebuild the engine")
            value = record[name]
            if not isinstance(value, kind) or isinstance(value, bool) or (name in DIMENSIONS and value < 1):
                raise ArtifactError(f"{path} is invalid: field {field} is {value!r}; rebuild the engine")
    _check_contents(manifest, path)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_contents(manifest: dict, path: Path) -> None:
    """The insides of FIELDS' lists and records (a hand-edited or hostile manifest ended in tracebacks)."""
    precision, graph = manifest["precision"], manifest["graph"]
    checks = [
        ("tokenizer.files", manifest["tokenizer"]["files"], lambda v: all(isinstance(f, str) for f in v)),
        ("tokenizer.eos_token_ids", manifest["tokenizer"]["eos_token_ids"], lambda v: all(_is_id(i) for i in v)),
        ("source.dtypes", manifest["source"]["dtypes"], lambda v: all(isinstance(d, str) for d in v)),
        ("kv_cache.dtype", manifest["kv_cache"]["dtype"], lambda v: v in KV_DTYPES),
        ("precision.session_config", precision.get("session_config", {}),
         lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())),
        ("precision.min_rows", precision.get("min_rows"),
         lambda v: v is None or (isinstance(v, str) and _is_id(precision.get("block_size")))),
    ]
    def tensor(v) -> bool:        # {"shape": [int | str, ...], "dtype": str}
        return (isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype", ""), str)
                and all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in v["shape"]))

    checks += [(f"graph.{kind}.{name}", info, tensor) for kind in ("inputs", "outputs")
               for name, info in graph[kind].items()]
    for field, value, ok in checks:
        if not ok(value):
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
        file = path(engine_dir, manifest, rel)
        if not file.is_file():
            raise ArtifactError(f"{engine_dir} is incomplete: {rel} is missing; rebuild the engine")
        if file.stat().st_size != info["size"]:
            raise ArtifactError(f"{engine_dir} is corrupted: {rel} has {file.stat().st_size} bytes, "
                                f"manifest says {info['size']} (truncated?); rebuild the engine")
        if sha256_file(file, getattr(manifest, "stamps", None), rel) != info["sha256"]:
            raise ArtifactError(f"{engine_dir} is corrupted: sha256 of {rel} does not match the manifest; "
                                "rebuild the engine")


def load(engine_dir: Path, verify: bool = True) -> dict:
    """Read and (by default) verify an engine; return its manifest."""
    manifest = read_manifest(engine_dir)
    if verify:
        verify_files(engine_dir, manifest)
    return manifest
