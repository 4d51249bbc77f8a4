// qs_last_error and the helpers that fill it; one message buffer per host thread.
#include "common.cuh"

namespace {
thread_local char g_message[512] = "";
}

namespace qs {

int fail(qs_status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_message, sizeof(g_message), fmt, args);
  va_end(args);
  return status;
}

int ok() {
  g_message[0] = '\0';
  return QS_OK;
}

int from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ok();
  cudaGetLastError();  // clear the sticky-free error so the next call starts clean
  return fail(QS_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

}  // namespace qs

extern "C" const char* qs_last_error(void) { return g_message; }

extern "C" int qs_device_memory(size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr)
    return qs::fail(QS_ERR_INVALID_ARGUMENT, "free_bytes and total_bytes must not be NULL");
  return qs::from_cuda(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
}
