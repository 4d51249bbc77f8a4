"""GraphBuilder: emits ONNX nodes with hierarchical names and streams weights into one external data file.

Weights never pass through protobuf: each initializer is appended to `<graph>.data` as it is produced
(64-byte aligned) and referenced by offset, so peak memory is one tensor and graphs over 2 GB need no
special case. Small constants (shapes, axes) are deduplicated and stored inline.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21
MS_DOMAIN = "com.microsoft"
QS_DOMAIN = "qs"               # Quicksilver's own cpu ops (plugins/cpu, registered from runtime._native)
_ALIGN = 64
_INLINE_BYTES = 1024


class GraphBuilder:
    def __init__(self, data_path: Path, name: str = "quicksilver"):
        self.name = name
        self.data_path = data_path
        self._data = open(data_path, "wb")
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._constants: dict[tuple, str] = {}
        self._names: set[str] = set()

    # -- values -------------------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """Append a weight to the external data file and reference it by offset."""
        array = np.ascontiguousarray(array)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        pad = -self._data.tell() % _ALIGN
        self._data.write(b"\0" * pad)
        offset = self._data.tell()
        self._data.write(array.tobytes())
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name

    def const(self, values, dtype=np.int64) -> str:
        """A small inline constant, deduplicated by value."""
        array = np.asarray(values, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            assert array.nbytes <= _INLINE_BYTES, "large constants must be weights"
            name = f"/const/{len(self._constants)}"
            self.initializers.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def overridable(self, name: str, values, dtype=np.int64) -> str:
        """A small inline constant under a fixed name, which a session may replace at load
        (SessionOptions.add_initializer): a graph setting the runtime can decide on the machine it runs on."""
        if name not in {t.name for t in self.initializers}:
            self.initializers.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    # -- nodes --------------------------------------------------------------------------------
    def node(self, op: str, inputs: list[str], name: str, num_outputs: int = 1, domain: str = "",
             outputs: list[str] | None = None, **attrs) -> list[str]:
        """Emit one node named `name` (unique, hierarchical); outputs default to `name/output_i`."""
        assert name not in self._names, f"duplicate node name {name}"
        self._names.add(name)
        outputs = outputs or [f"{name}/output_{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def op(self, op: str, inputs: list[str], name: str, domain: str = "", **attrs) -> str:
        """Emit a single-output node and return its output name."""
        return self.node(op, inputs, name, domain=domain, **attrs)[0]

    def interface(self) -> dict:
        """The declared inputs and outputs as the manifest records them: dtype and shape (names of symbolic
        dims), per-layer names collapsed into one `{layer}` entry."""
        def describe(values: list[onnx.ValueInfoProto]) -> dict:
            out: dict[str, dict] = {}
            for v in values:
                t = v.type.tensor_type
                out.setdefault(re.sub(r"\.\d+(?=\.|$)", ".{layer}", v.name),
                               {"dtype": np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name,
                                "shape": [d.dim_param or d.dim_value for d in t.shape.dim]})
            return out

        return {"inputs": describe(self.inputs), "outputs": describe(self.outputs)}

    # -- finish -------------------------------------------------------------------------------
    def save(self, graph_path: Path) -> None:
        self._data.close()
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, producer_name="quicksilver-compile",
                                  opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1),
                                                 helper.make_opsetid(QS_DOMAIN, 1)])
        model.ir_version = 10
        onnx.save_model(model, str(graph_path))
