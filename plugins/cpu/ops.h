// Quicksilver's ONNX Runtime ops for cpu engines (domain "qs"), registered by RegisterCustomOps (register.cpp).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

const OrtCustomOp* qs_causal_attention_op();   // attention.cpp
const OrtCustomOp* qs_row_quantize_op();       // row_quantize.cpp
