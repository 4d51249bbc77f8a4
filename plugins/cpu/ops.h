// Quicksilver's ONNX Runtime ops for cpu engines (domain "qs"), registered by RegisterCustomOps (register.cpp).
#pragma once

#include <cstdint>

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

const OrtCustomOp* qs_causal_attention_op();   // attention.cpp
const OrtCustomOp* qs_row_quantize_op();       // row_quantize.cpp
const OrtCustomOp* qs_int8_matmul_op();        // int8_matmul.cpp
const OrtCustomOp* qs_packed_gather_op();      // int8_matmul.cpp
const OrtCustomOp* qs_int4_matmul_op();        // int4_matmul.cpp
const OrtCustomOp* qs_int4_gather_op();        // int4_matmul.cpp

// One row → uint8 (zero point 128) on its own scale max|x|/127; shared by RowQuantize, Int8MatMul and Int4MatMul.
void qs_quantize_row(const float* __restrict x, int64_t k, uint8_t* __restrict q, float* __restrict scale);
