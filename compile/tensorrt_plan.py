"""`--target tensorrt`: build a TensorRT plan from the graph, where TensorRT and a GPU exist.

The graph is standard ONNX ops plus QsPagedAttention nodes, which TensorRT's ONNX parser resolves to our
plugin (plugins/tensorrt, libqs_trt_plugins.so) once the library is loaded. A plan is specific to the GPU
and TensorRT version that built it, so without TensorRT the artifact carries the TensorRT-ready graph and
no plan. Not run in CI (TensorRT cannot be installed there).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import QuicksilverError

PLAN_FILE = "model.plan"
BLOCK_SIZE = 16              # the block size the plan's cache inputs are fixed to
MAX_TOKENS, MAX_BATCH, MAX_BLOCKS_TOTAL = 512, 64, 65536


def plugin_library() -> Path:
    """libqs_trt_plugins.so: QS_TRT_PLUGINS, else installed next to the runtime package."""
    env = os.environ.get("QS_TRT_PLUGINS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "runtime" / "libqs_trt_plugins.so"


def build_plan(graph: Path, out: Path, precision: str, max_seq_len: int, kv_heads: int, head_dim: int, log) -> bool:
    """Write the plan to `out`; False (and say so) when TensorRT is not installed here."""
    try:
        import tensorrt as trt
    except ImportError:
        log("TensorRT is not installed here: the engine carries the TensorRT-ready graph without a plan; "
            "build it on the GPU machine (pip install tensorrt, and the plugin with the TensorRT SDK)")
        return False
    lib = plugin_library()
    if not lib.is_file():
        raise QuicksilverError(f"the QsPagedAttention plugin is not built ({lib}): install with the TensorRT SDK "
                               "present (TENSORRT_ROOT=… pip install . -C cmake.define.QS_BUILD_CUDA=ON)")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    builder.get_plugin_registry().load_library(str(lib))
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise QuicksilverError(f"TensorRT cannot parse {graph}: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    if precision == "fp8":
        config.set_flag(trt.BuilderFlag.FP8)
    elif precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    blocks = -(-max_seq_len // BLOCK_SIZE)
    cache = ((1, BLOCK_SIZE, kv_heads, head_dim), (MAX_BATCH * blocks // 4 or 1, BLOCK_SIZE, kv_heads, head_dim),
             (MAX_BLOCKS_TOTAL, BLOCK_SIZE, kv_heads, head_dim))
    shapes = {"input_ids": ((1,), (64,), (MAX_TOKENS,)), "slot_mapping": ((1,), (64,), (MAX_TOKENS,)),
              "logits_indices": ((1,), (8,), (MAX_TOKENS,)),
              "cumulative_sequence_length": ((2,), (9,), (MAX_BATCH + 1,)),
              "past_seqlens": ((1,), (8,), (MAX_BATCH,)), "block_table": ((1, 1), (8, blocks), (MAX_BATCH, blocks))}
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        profile.set_shape(name, *(cache if name.startswith(("key_cache.", "value_cache.")) else shapes[name]))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise QuicksilverError("TensorRT failed to build the plan (see its log above)")
    out.write_bytes(bytes(plan))
    log(f"built TensorRT plan {out.name} ({out.stat().st_size / 2**20:.1f} MiB)")
    return True
