/* CUDA dtype casts on device memory.
 *
 * Built only when CMake finds a CUDA toolkit (target sp_cast_cuda;
 * shardplane/config.h says SHARDPLANE_HAVE_CUDA), except
 * sp_cuda_device_count, which every build has. Includable from C: it needs
 * no CUDA header. The kernels call the same cast_scalar.h functions as the CPU
 * paths, so a GPU cast gives the same bits as sp_cast() on every input,
 * including NaN payloads (the float32 -> bfloat16 NaN case is handled in
 * integer code rather than left to cvt.rn.bf16.f32, whose NaN output is not
 * documented).
 */
#ifndef SP_CAST_CUDA_H
#define SP_CAST_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "base/sp_error.h"
#include "shardplane/config.h"

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
 * take the vectorized kernels (16-byte loads and stores, grid-stride, the
 * ragged ends one element at a time).
 * Errors: SP_EINVAL (NULL pointer with n > 0, non-floating dtype, dst ==
 * src with different element sizes), SP_ECUDA (launch failed; the CUDA
 * error is logged with file and line). */
int sp_cuda_cast(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
                 size_t n, void *stream);

/* The same cast between element offsets: n elements from src + src_off
 * (elements of src_t) to dst + dst_off (elements of dst_t). This is the
 * fused "cast my shard into its slot of the all-gather input" of the FSDP
 * runtime (dst_off = rank * shard elements), one kernel and no staging
 * buffer. Bits and errors as sp_cuda_cast; the vector kernels are used
 * whenever some element index makes both addresses 16-byte aligned at once
 * (the few elements before it are done one by one), so a slot offset that
 * is a multiple of 8 elements (16 bytes of bfloat16) keeps full speed with
 * every source dtype. SP_EINVAL also when an offset overflows. */
int sp_cuda_cast_at(void *dst, size_t dst_off, sp_dtype dst_t, const void *src,
                    size_t src_off, sp_dtype src_t, size_t n, void *stream);

/* Casts a reduced gradient shard back to the master dtype, dividing by
 * `div` (FSDP's post-divide factor) on the way: the fused form of
 * client/lib/fsdp/fsdp_mem_host.c's "scale_div(red_out, reduce dtype, post)
 * then sp_cast to the gradient dtype", with exactly its bits, so the GPU
 * and CPU runtimes agree. src_t is the reduce dtype, dst_t the master
 * (shard) dtype; any of
 * float64, float32, float16, bfloat16 each, equal dtypes included. For each
 * element x (src_t) the result is
 *   float64 x:          q = x / div                      (IEEE double, RNE)
 *   float32 x:          q = (float)((double)x / div)      (for a div that
 *                       is a float value this is the correctly rounded
 *                       float quotient: 53 >= 2*24 + 2)
 *   float16/bfloat16 x: f = (float)x (exact), q = cast_{src_t}((float)
 *                       ((double)f / div)) (rounded to float32, then to
 *                       src_t with the cast policy: the dtype FSDP divides
 *                       in. For the integer and power-of-two divisors FSDP
 *                       uses this equals the single correctly rounded
 *                       quotient in src_t, as 24 >= 2*11 + 2)
 *   then out = cast_{dst_t}(q) with the cast policy (exact when widening).
 * Every narrowing is round to nearest even without flushing subnormals
 * (cast_scalar.h integer code; the one floating operation is the IEEE
 * double division, which the GPU and x86-64 do identically). A NaN x gives
 * cast_{dst_t}(x with its quiet bit set): x86-64 arithmetic keeps a NaN's
 * sign and payload and quiets it, so the CPU runtime agrees (this is only
 * visible for a signalling NaN with dst_t == src_t; every cast quiets
 * anyway). div == 1 is exactly sp_cuda_cast, as the CPU runtime skips the
 * division then (a signalling NaN is copied unchanged between equal
 * dtypes). Pointers must be aligned to their element sizes (every real
 * buffer is); 16-byte aligned ones take the vector kernels. In place (dst
 * == src) only with equal element sizes.
 * Errors: SP_EINVAL (NULL pointer with n > 0, non-floating dtype, div zero,
 * infinite or NaN, a pointer not aligned to its element size), SP_ECUDA. */
int sp_cuda_cast_div(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
                     size_t n, double div, void *stream);

/* Number of CUDA devices usable by this process. A machine without a GPU or
 * without a driver, or a build without CUDA (cast_cuda_stub.c), is not an
 * error: *n = 0 and 0 is returned; so this one is in every build.
 * Errors: SP_EINVAL (n NULL), SP_ECUDA (the driver reported something other
 * than "no device"; *n = 0). */
int sp_cuda_device_count(int *n);

/* Free and total memory of CUDA device `device` in bytes (the memory
 * check before a job starts compares its prediction with the free part).
 * The device becomes the calling thread's current one. In every build: a
 * build without CUDA answers SP_EUNSUPPORTED. Errors: SP_EINVAL, SP_ECUDA
 * (d names the call). */
int sp_cuda_device_memory(int device, uint64_t *free_b, uint64_t *total_b,
                          sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
