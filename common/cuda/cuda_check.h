/* The one check of a CUDA runtime call, for every kernel's host code (the
 * casts in common/cast/, the FSDP runtime's in client/lib/fsdp/, the
 * worker's models): a failure becomes SP_ECUDA with the file, line, call
 * and CUDA's name and words for the error. Includable from C without CUDA
 * headers; cuda_check.c is only built with CUDA (SHARDPLANE_HAVE_CUDA).
 * Never exits: library code returns errors, and a worker decides for
 * itself how to fail. */
#ifndef SP_CUDA_CHECK_H
#define SP_CUDA_CHECK_H

#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "file:line: expr: CUDA error NAME (description)" for a cudaError_t err;
 * returns SP_ECUDA. Into d, clearing a non-sticky error from the runtime's
 * last-error slot so that the next check does not trip over this one; or,
 * with d NULL (callers with no sp_diag to fill, the casts), as a line on
 * stderr, the slot left as it is. */
int sp_cuda_diag(sp_diag *d, int err, const char *expr, const char *file,
                 int line);

/* Evaluates a CUDA runtime call (or anything returning a cudaError_t); on
 * failure returns sp_cuda_diag's SP_ECUDA from the enclosing function,
 * which must return int. */
#define SP_CUDA_CHECK(d, call) SP_CUDA_CHECK_WITH(sp_cuda_diag, d, call)

/* The same for a library of CUDA's whose calls return another status type
 * (0 for success), named by its own diag function of sp_cuda_diag's
 * signature: the worker's cuBLAS check is this over sp_cublas_diag. */
#define SP_CUDA_CHECK_WITH(diag, d, call)                        \
  do {                                                           \
    int sp_cuda_err_ = (int)(call);                              \
    if (sp_cuda_err_ != 0)                                       \
      return diag((d), sp_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

/* After a kernel launch: SP_CUDA_CHECK(d, cudaGetLastError()) reports a
 * failed launch; faults during the run surface at the next synchronizing
 * call on the stream, which is checked as well. */

#ifdef __cplusplus
}
#endif

#endif
