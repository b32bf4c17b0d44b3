/* CUDA dtype casts on device memory, and the CUDA error-checking macro.
 *
 * Built only when CMake finds a CUDA toolkit (target sp_cuda, which defines
 * SHARDPLANE_HAVE_CUDA for its users). Includable from C: it needs no CUDA
 * header. The kernels call the same cast_scalar.h functions as the CPU
 * paths, so a GPU cast gives the same bits as sp_cast() on every input,
 * including NaN payloads (the float32 -> bfloat16 NaN case is handled in
 * integer code rather than left to cvt.rn.bf16.f32, whose NaN output is not
 * documented).
 */
#ifndef SP_CAST_CUDA_H
#define SP_CAST_CUDA_H

#include <stddef.h>

#include "dtype.h"
#include "sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Converts n elements from src (dtype src_t) to dst (dtype dst_t), both
 * device pointers on the current device, enqueued on `stream` (a
 * cudaStream_t; NULL is the legacy default stream). Asynchronous: returns
 * after the launch, and kernel faults surface at the next synchronizing
 * call on that stream. Same dtype rules as sp_cast(): both floating, equal
 * dtypes copy, no overlap except the same pointer with equal element sizes.
 * Any alignment works; 16-byte aligned buffers (every cudaMalloc result)
 * take the vectorized kernels.
 * Errors: SP_EINVAL (NULL pointer with n > 0, non-floating dtype),
 * SP_ECUDA (launch failed; the CUDA error is logged with file and line). */
int sp_cuda_cast(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
                 size_t n, void *stream);

/* Number of CUDA devices usable by this process. A machine without a GPU or
 * without a driver is not an error: *n = 0 and 0 is returned.
 * Errors: SP_EINVAL (n NULL), SP_ECUDA (the driver reported something other
 * than "no device"; *n = 0). */
int sp_cuda_device_count(int *n);

/* Logs "file:line: expr: CUDA error NAME (description)" to stderr and
 * returns SP_ECUDA; used by SP_CUDA_CHECK. `err` is a cudaError_t. */
int sp_cuda_report(int err, const char *expr, const char *file, int line);

/* Evaluates a CUDA runtime call; on failure logs where and returns
 * SP_ECUDA from the enclosing function (which must return int). Never
 * exits: a worker decides for itself how to fail. */
#define SP_CUDA_CHECK(call)                                                    \
  do {                                                                         \
    int sp_cuda_check_err_ = (int)(call);                                      \
    if (sp_cuda_check_err_ != 0)                                               \
      return sp_cuda_report(sp_cuda_check_err_, #call, __FILE__, __LINE__);    \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
