/* CPU dtype-cast kernels.
 *
 * Policy (docs/fsdp.md, "Cast rules"), identical on every path:
 *   - round-to-nearest-even, computed in integer arithmetic so the result does
 *     not depend on MXCSR (FTZ/DAZ/rounding mode) of the calling thread;
 *   - subnormal inputs and outputs are converted exactly, never flushed;
 *   - overflow goes to infinity of the same sign;
 *   - a NaN stays NaN: sign kept, top payload bits kept, quiet bit set
 *     (for float32 -> bfloat16 that is (u >> 16) | 0x0040).
 *
 * Paths: a scalar reference (common/cast/cast_scalar.h, also compiled for CUDA) and
 * SIMD paths (AVX2+F16C, AVX-512) picked at run time from CPU features. Every
 * path gives the same bits as the scalar reference on every input; the tests
 * prove it over all 2^32 float32 inputs.
 */
#ifndef SP_CAST_H
#define SP_CAST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sp_cast_path {
  SP_CAST_PATH_AUTO = 0, /* the fastest path this CPU supports */
  SP_CAST_PATH_SCALAR = 1,
  SP_CAST_PATH_AVX2 = 2,   /* AVX2 + F16C */
  SP_CAST_PATH_AVX512 = 3, /* AVX-512 F + BW + VL */
  SP_CAST_PATH_COUNT
} sp_cast_path;

/* Whether this CPU (and this build) can run `path`. AUTO and SCALAR: true. */
bool sp_cast_path_available(sp_cast_path path);
/* "auto", "scalar", "avx2", "avx512"; never NULL. */
const char *sp_cast_path_name(sp_cast_path path);
/* The path AUTO resolves to on this CPU. */
sp_cast_path sp_cast_path_best(void);

/* Converts n elements from src (dtype src_t) into dst (dtype dst_t).
 * Both dtypes must be floating; equal dtypes copy. dst and src must not
 * overlap unless they are the same pointer with equal element sizes.
 * No alignment requirement.
 * Errors: SP_EINVAL (NULL pointer with n > 0, non-floating or invalid dtype),
 * SP_EUNSUPPORTED (path not available on this CPU).
 *
 * Thread-safe (the only shared state is the one-time CPU detection).
 * Runs on the calling thread only. The result bits do not depend on the
 * thread's floating-point environment (MXCSR rounding mode, FTZ, DAZ).
 * Destinations beyond the cache (half the last-level cache, at most
 * 16 MiB) are written with streaming stores, so after a large cast the
 * result is in memory, not in the cache. Only float32 <-> bfloat16 and
 * float32 <-> float16 have SIMD kernels; the other pairs run the scalar
 * loop on every path. */
int sp_cast(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
            size_t n);
int sp_cast_with_path(void *dst, sp_dtype dst_t, const void *src,
                      sp_dtype src_t, size_t n, sp_cast_path path);

#ifdef __cplusplus
}
#endif
#endif
