/* The check of a cuBLAS call (cublas_check.h). */
#include <cublas_v2.h>

#include "cublas_check.h"

extern "C" int sp_cublas_diag(sp_diag *d, int status, const char *expr,
                              const char *file, int line) {
  cublasStatus_t s = (cublasStatus_t)status;
  return sp_diag_set(d, SP_ECUDA, "%s:%d: %s: cuBLAS error %s (%s)", file, line,
                     expr, cublasGetStatusName(s), cublasGetStatusString(s));
}
