"""Opening an engine's ONNX graph, shared by the cpu and paged backends' ONNX Runtime runners."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

import artifact
from artifact.errors import ArtifactError


def open_session(engine_dir: Path, manifest: dict, so: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    """The engine's graph as an ONNX Runtime session, checked against the manifest's declared inputs and outputs;
    the graph and its external data must be listed files inside the engine (artifact.graph_path). Any load
    failure is one ArtifactError line (ORT raises its own exception types for a bad graph)."""
    graph = artifact.graph_path(engine_dir, manifest)
    try:
        session = ort.InferenceSession(str(graph), so, providers=providers)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArtifactError(f"{engine_dir}: ONNX Runtime cannot load the graph: {first}") from None
    artifact.check_graph_io(manifest, engine_dir, [i.name for i in session.get_inputs()],
                            [o.name for o in session.get_outputs()])
    return session
