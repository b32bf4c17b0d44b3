/* The check of a CUDA runtime call (cuda_check.h). */
#include "cuda_check.h"

#include <cuda_runtime_api.h>
#include <stdio.h>

int sp_cuda_diag(sp_diag *d, int err, const char *expr, const char *file,
                 int line) {
  cudaError_t e = (cudaError_t)err;
  if (d == NULL) {
    fprintf(stderr, "%s:%d: %s: CUDA error %s (%s)\n", file, line, expr,
            cudaGetErrorName(e), cudaGetErrorString(e));
    return SP_ECUDA;
  }
  /* a sticky error (a kernel fault) stays and fails every later call, as
   * it must */
  (void)cudaGetLastError();
  return sp_diag_set(d, SP_ECUDA, "%s:%d: %s: CUDA error %s (%s)", file, line,
                     expr, cudaGetErrorName(e), cudaGetErrorString(e));
}
