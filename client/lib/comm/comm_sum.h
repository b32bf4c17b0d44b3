/* The deterministic sums that every host-memory reduction goes through:
 * comm.c's for a single member, the Gloo backend's (comm_gloo.cc) for many.
 * One definition, so a result depends only on the inputs and their order,
 * never on the group size or the backend.
 *
 * Included by C and by the Gloo bridge (C++), so plain C types only. */
#ifndef SP_COMM_SUM_H
#define SP_COMM_SUM_H

#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether sums are defined for dt: float32, float64, bfloat16, float16,
 * int64, int32. */
int sp_comm_dtype_summable(sp_dtype dt);

/* dst[k] = blocks[0][k] + blocks[1][k] + ... + blocks[n-1][k], added in that
 * order, for k < count. bfloat16/float16 are widened exactly to float32,
 * summed in float32 and rounded once to nearest even (common/cast/cast_scalar.h);
 * integers wrap modulo 2^bits. A NaN sum is stored as the default quiet
 * NaN (positive, payload 0): which input's payload an addition keeps is up
 * to the compiler's operand order, so it could not be promised. dst may be the
 * same memory as any block (the same elements), since each chunk is read
 * completely before it is written. Returns 0, or SP_EINVAL for a dtype without
 * sums. */
int sp_comm_sum_blocks(void *dst, const void *const *blocks, uint32_t n,
                       size_t count, sp_dtype dt);

#ifdef __cplusplus
}
#endif
#endif
