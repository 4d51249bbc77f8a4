// The entry point ONNX Runtime calls when a session registers this library (runtime/cpu_ops.py: the file of
// runtime._native, which these sources are compiled into).
#include <exception>

#include "ops.h"

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    static Ort::CustomOpDomain domain{"qs"};   // one per process: every session shares the op definitions
    static bool filled = [] {
      domain.Add(qs_causal_attention_op());
      domain.Add(qs_causal_attention_f16_op());
      domain.Add(qs_row_quantize_op());
      domain.Add(qs_int8_matmul_op());
      domain.Add(qs_packed_gather_op());
      domain.Add(qs_int4_matmul_op());
      domain.Add(qs_int4_gather_op());
      domain.Add(qs_swiglu_op());
      return true;
    }();
    (void)filled;
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
