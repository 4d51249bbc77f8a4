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
