// TensorRT IPluginV3 "QsPagedAttention": in-flight batched paged attention for TensorRT engines built from
// the `--target tensorrt` graph. It wraps qs_packed_paged_attention (plugins/cuda/packed.cu), so the
// semantics are those of ONNX Runtime's com.microsoft.PagedAttention and of the `--target cuda` graph:
//
//   inputs   0 qkv [tokens, (H + 2·KVH)·D]   1 key_cache, 2 value_cache [blocks, block_size, KVH, D]
//            3 cumulative_sequence_length [B+1]   4 past_seqlens [B]   5 block_table [B, max_blocks]
//            6 cos_cache, 7 sin_cache [max_pos, D/2]   8 slot_mapping [tokens]          (ints: int32)
//   outputs  0 attention [tokens, H·D]   1, 2 the caches, aliased to inputs 1, 2 (updated in place)
//   fields   num_heads, kv_num_heads, head_dim, max_seq_len, local_window_size (int32), scale (float32)
//
// Built only when CMake finds the TensorRT SDK (-DQS_BUILD_TENSORRT=ON); TensorRT loads it with
// IPluginRegistry::loadLibrary, which calls getCreators below.
#include <NvInferRuntime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "qs_cuda.h"

using namespace nvinfer1;

namespace {

constexpr char const* kName = "QsPagedAttention";
constexpr char const* kVersion = "1";
constexpr char const* kNamespace = "";
constexpr int32_t kInputs = 9, kOutputs = 3;

struct Fields {
  int32_t num_heads = 0, kv_num_heads = 0, head_dim = 0, max_seq_len = 0, window = 0;
  float scale = 0.f;
};

class PagedAttentionPlugin final : public IPluginV3,
                                   public IPluginV3OneCore,
                                   public IPluginV3OneBuildV2,
                                   public IPluginV3OneRuntime {
 public:
  explicit PagedAttentionPlugin(Fields f) : f_(f) { describe(); }

  // -- IPluginV3 --------------------------------------------------------------------------------
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override { return new (std::nothrow) PagedAttentionPlugin(f_); }

  // -- core -------------------------------------------------------------------------------------
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

  // -- build ------------------------------------------------------------------------------------
  int32_t getNbOutputs() const noexcept override { return kOutputs; }

  int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const* in, int32_t nbInputs) const noexcept override {
    if (nbOutputs != kOutputs || nbInputs != kInputs) return -1;
    out[0] = in[0];
    out[1] = in[1];
    out[2] = in[2];
    return 0;
  }

  int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out,
                          int32_t nbOutputs, IExprBuilder& expr) noexcept override {
    if (nbInputs != kInputs || nbOutputs != kOutputs || in[0].nbDims != 2) return -1;
    out[0].nbDims = 2;
    out[0].d[0] = in[0].d[0];
    out[0].d[1] = expr.constant(static_cast<int64_t>(f_.num_heads) * f_.head_dim);
    out[1] = in[1];
    out[2] = in[2];
    return 0;
  }

  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t, int32_t) noexcept override {
    PluginTensorDesc const& d = io[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    const bool ints = pos == 3 || pos == 4 || pos == 5 || pos == 8;
    if (ints) return d.type == DataType::kINT32;
    if (pos == 0) return d.type == DataType::kHALF || d.type == DataType::kBF16;
    return d.type == io[0].desc.type;  // caches, cos/sin and outputs follow qkv
  }

  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
                          int32_t nbOutputs) noexcept override {
    if (nbInputs != kInputs || nbOutputs != kOutputs || in[1].desc.dims.nbDims != 4) return -1;
    return 0;
  }

  size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t, DynamicPluginTensorDesc const*, int32_t) const noexcept override {
    const int tokens = static_cast<int>(in[0].max.d[0]);
    const int seqs = static_cast<int>(in[4].max.d[0]);
    const int head_dim = static_cast<int>(in[1].max.d[3]);
    return qs_packed_attention_workspace_size(tokens, seqs, f_.num_heads, head_dim, f_.max_seq_len) + 256;
  }

  int32_t getAliasedInput(int32_t outputIndex) noexcept override { return outputIndex == 1 ? 1 : outputIndex == 2 ? 2 : -1; }

  // -- runtime ----------------------------------------------------------------------------------
  int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override { return 0; }

  int32_t enqueue(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs, void* const* outputs,
                  void* workspace, cudaStream_t stream) noexcept override {
    const int tokens = static_cast<int>(in[0].dims.d[0]);
    const int seqs = static_cast<int>(in[4].dims.d[0]);
    const int max_blocks = static_cast<int>(in[5].dims.d[1]);
    const int block_size = static_cast<int>(in[1].dims.d[1]);
    const int head_dim = static_cast<int>(in[1].dims.d[3]);
    const qs_dtype dtype = in[0].type == DataType::kHALF ? QS_DTYPE_F16 : QS_DTYPE_BF16;
    // TensorRT aligns workspaces to 256 bytes already; keep the size exact for the kernel's check.
    const size_t bytes = qs_packed_attention_workspace_size(tokens, seqs, f_.num_heads, head_dim, f_.max_seq_len);
    const float scale = f_.scale > 0.f ? f_.scale : 1.f / std::sqrt(static_cast<float>(head_dim));
    return qs_packed_paged_attention(
        outputs[0], inputs[0], outputs[1], outputs[2], static_cast<int32_t const*>(inputs[3]),
        static_cast<int32_t const*>(inputs[4]), static_cast<int32_t const*>(inputs[5]),
        static_cast<int32_t const*>(inputs[8]), inputs[6], inputs[7], tokens, seqs, f_.num_heads, f_.kv_num_heads,
        head_dim, block_size, max_blocks, f_.max_seq_len, f_.window, scale, dtype, workspace, bytes, stream) == QS_OK
        ? 0 : -1;
  }

  IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &collection_; }

 private:
  void describe() {
    fields_ = {PluginField("num_heads", &f_.num_heads, PluginFieldType::kINT32, 1),
               PluginField("kv_num_heads", &f_.kv_num_heads, PluginFieldType::kINT32, 1),
               PluginField("head_dim", &f_.head_dim, PluginFieldType::kINT32, 1),
               PluginField("max_seq_len", &f_.max_seq_len, PluginFieldType::kINT32, 1),
               PluginField("local_window_size", &f_.window, PluginFieldType::kINT32, 1),
               PluginField("scale", &f_.scale, PluginFieldType::kFLOAT32, 1)};
    collection_.nbFields = static_cast<int32_t>(fields_.size());
    collection_.fields = fields_.data();
  }

  Fields f_;
  std::vector<PluginField> fields_;
  PluginFieldCollection collection_{};
};

class PagedAttentionCreator final : public IPluginCreatorV3One {
 public:
  PagedAttentionCreator() {
    names_ = {PluginField("num_heads", nullptr, PluginFieldType::kINT32, 1),
              PluginField("kv_num_heads", nullptr, PluginFieldType::kINT32, 1),
              PluginField("max_seq_len", nullptr, PluginFieldType::kINT32, 1),
              PluginField("local_window_size", nullptr, PluginFieldType::kINT32, 1),
              PluginField("head_dim", nullptr, PluginFieldType::kINT32, 1),
              PluginField("scale", nullptr, PluginFieldType::kFLOAT32, 1)};
    collection_.nbFields = static_cast<int32_t>(names_.size());
    collection_.fields = names_.data();
  }

  IPluginV3* createPlugin(AsciiChar const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    Fields f;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      PluginField const& p = fc->fields[i];
      if (p.data == nullptr) continue;
      // The ONNX parser passes ONNX int attributes as kINT32 and floats as kFLOAT32.
      if (!std::strcmp(p.name, "num_heads")) f.num_heads = *static_cast<int32_t const*>(p.data);
      else if (!std::strcmp(p.name, "kv_num_heads")) f.kv_num_heads = *static_cast<int32_t const*>(p.data);
      else if (!std::strcmp(p.name, "max_seq_len")) f.max_seq_len = *static_cast<int32_t const*>(p.data);
      else if (!std::strcmp(p.name, "local_window_size")) f.window = *static_cast<int32_t const*>(p.data);
      else if (!std::strcmp(p.name, "head_dim")) f.head_dim = *static_cast<int32_t const*>(p.data);
      else if (!std::strcmp(p.name, "scale")) f.scale = *static_cast<float const*>(p.data);
    }
    if (f.num_heads < 1 || f.kv_num_heads < 1 || f.head_dim < 1 || f.max_seq_len < 1) return nullptr;
    return new (std::nothrow) PagedAttentionPlugin(f);
  }

  PluginFieldCollection const* getFieldNames() noexcept override { return &collection_; }
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

 private:
  std::vector<PluginField> names_;
  PluginFieldCollection collection_{};
};

}  // namespace

// Entry point TensorRT looks for in a plugin library (IPluginRegistry::loadLibrary).
extern "C" __attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static PagedAttentionCreator creator;
  static IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}
