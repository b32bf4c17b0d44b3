/* CUDA cast kernels, next to their CPU reference: every element goes
 * through the cast_scalar.h function the CPU scalar path uses, so the two
 * agree bit for bit by construction and the GPU test only has to prove the
 * plumbing (indexing, vector packing, tails) over all inputs.
 *
 * Written in the C subset of CUDA C++ (macros instead of templates) so it
 * reads like the rest of common/.
 *
 * Three kernels per dtype pair, chosen per call by pointer alignment:
 *   - vec:  both pointers 16-byte aligned (every cudaMalloc result). Each
 *           thread moves 8 elements with 16-byte loads and stores, which is
 *           what lets a memory-bound cast approach copy bandwidth; loads and
 *           stores carry the streaming (evict-first) hint because a cast
 *           touches each byte once. The n % 8 tail is done by the first
 *           threads of the same launch.
 *   - elem: pointers aligned to their element sizes; one element a thread.
 *   - byte: anything else (a tensor view at an odd byte offset); typed
 *           loads would fault there, so elements are assembled bytewise.
 * All are grid-stride loops, so the grid can be capped at a few blocks per
 * SM regardless of n.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cast_cuda.h"
#include "cast_scalar.h"

#define SP_CUDA_THREADS 256
#define SP_CUDA_VEC 8 /* elements per thread in the vec kernels */

#define SP_CUDA_TID() ((size_t)blockIdx.x * blockDim.x + threadIdx.x)
#define SP_CUDA_STRIDE() ((size_t)gridDim.x * blockDim.x)

#define SP_CUDA_PAIR(name, ST, DT, FN)                                         \
  __global__ void sp_cuda_k_vec_##name(DT *dst, const ST *src, size_t nvec,    \
                                       size_t rem) {                           \
    enum {                                                                     \
      SQ = (int)(sizeof(ST) * SP_CUDA_VEC / 16),                               \
      DQ = (int)(sizeof(DT) * SP_CUDA_VEC / 16)                                \
    };                                                                         \
    for (size_t v = SP_CUDA_TID(); v < nvec; v += SP_CUDA_STRIDE()) {          \
      union {                                                                  \
        uint4 q[SQ];                                                           \
        ST e[SP_CUDA_VEC];                                                     \
      } in;                                                                    \
      union {                                                                  \
        uint4 q[DQ];                                                           \
        DT e[SP_CUDA_VEC];                                                     \
      } out;                                                                   \
      const uint4 *s = (const uint4 *)(src + v * SP_CUDA_VEC);                 \
      uint4 *d = (uint4 *)(dst + v * SP_CUDA_VEC);                             \
      _Pragma("unroll") for (int k = 0; k < SQ; k++) in.q[k] = __ldcs(s + k);  \
      _Pragma("unroll") for (int k = 0; k < SP_CUDA_VEC; k++) out.e[k] =       \
          FN(in.e[k]);                                                         \
      _Pragma("unroll") for (int k = 0; k < DQ; k++) __stcs(d + k, out.q[k]);  \
    }                                                                          \
    size_t t = SP_CUDA_TID();                                                  \
    if (t < rem) {                                                             \
      size_t i = nvec * SP_CUDA_VEC + t;                                       \
      dst[i] = FN(src[i]);                                                     \
    }                                                                          \
  }                                                                            \
  __global__ void sp_cuda_k_elem_##name(DT *dst, const ST *src, size_t n) {    \
    for (size_t i = SP_CUDA_TID(); i < n; i += SP_CUDA_STRIDE())               \
      dst[i] = FN(src[i]);                                                     \
  }                                                                            \
  __global__ void sp_cuda_k_byte_##name(unsigned char *dst,                    \
                                        const unsigned char *src, size_t n) {  \
    for (size_t i = SP_CUDA_TID(); i < n; i += SP_CUDA_STRIDE()) {             \
      ST x;                                                                    \
      memcpy(&x, src + i * sizeof(ST), sizeof(ST));                            \
      DT y = FN(x);                                                            \
      memcpy(dst + i * sizeof(DT), &y, sizeof(DT));                            \
    }                                                                          \
  }                                                                            \
  static void sp_cuda_launch_##name(void *dst, const void *src, size_t n,      \
                                    unsigned max_blocks, cudaStream_t st) {    \
    uintptr_t da = (uintptr_t)dst, sa = (uintptr_t)src;                        \
    size_t work;                                                               \
    int mode;                                                                  \
    if (da % 16 == 0 && sa % 16 == 0) {                                        \
      mode = 0;                                                                \
      work = n / SP_CUDA_VEC;                                                  \
      if (work < n % SP_CUDA_VEC) work = n % SP_CUDA_VEC;                      \
    } else if (da % sizeof(DT) == 0 && sa % sizeof(ST) == 0) {                 \
      mode = 1;                                                                \
      work = n;                                                                \
    } else {                                                                   \
      mode = 2;                                                                \
      work = n;                                                                \
    }                                                                          \
    size_t b = (work + SP_CUDA_THREADS - 1) / SP_CUDA_THREADS;                 \
    unsigned blocks = b < max_blocks ? (unsigned)b : max_blocks;               \
    if (mode == 0)                                                             \
      sp_cuda_k_vec_##name<<<blocks, SP_CUDA_THREADS, 0, st>>>(                \
          (DT *)dst, (const ST *)src, n / SP_CUDA_VEC, n % SP_CUDA_VEC);       \
    else if (mode == 1)                                                        \
      sp_cuda_k_elem_##name<<<blocks, SP_CUDA_THREADS, 0, st>>>(               \
          (DT *)dst, (const ST *)src, n);                                      \
    else                                                                       \
      sp_cuda_k_byte_##name<<<blocks, SP_CUDA_THREADS, 0, st>>>(               \
          (unsigned char *)dst, (const unsigned char *)src, n);                \
  }

SP_CUDA_PAIR(f32_to_bf16, uint32_t, uint16_t, sp_f32_to_bf16_bits)
SP_CUDA_PAIR(bf16_to_f32, uint16_t, uint32_t, sp_bf16_to_f32_bits)
SP_CUDA_PAIR(f32_to_f16, uint32_t, uint16_t, sp_f32_to_f16_bits)
SP_CUDA_PAIR(f16_to_f32, uint16_t, uint32_t, sp_f16_to_f32_bits)
SP_CUDA_PAIR(f64_to_f32, uint64_t, uint32_t, sp_f64_to_f32_bits)
SP_CUDA_PAIR(f64_to_bf16, uint64_t, uint16_t, sp_f64_to_bf16_bits)
SP_CUDA_PAIR(f64_to_f16, uint64_t, uint16_t, sp_f64_to_f16_bits)
SP_CUDA_PAIR(f32_to_f64, uint32_t, uint64_t, sp_f32_to_f64_bits)
SP_CUDA_PAIR(bf16_to_f64, uint16_t, uint64_t, sp_bf16_to_f64_bits)
SP_CUDA_PAIR(f16_to_f64, uint16_t, uint64_t, sp_f16_to_f64_bits)
SP_CUDA_PAIR(bf16_to_f16, uint16_t, uint16_t, sp_bf16_to_f16_bits)
SP_CUDA_PAIR(f16_to_bf16, uint16_t, uint16_t, sp_f16_to_bf16_bits)

typedef void (*sp_cuda_launch_fn)(void *dst, const void *src, size_t n,
                                  unsigned max_blocks, cudaStream_t st);

static sp_cuda_launch_fn sp_cuda_pick(sp_dtype s, sp_dtype d) {
#define SP_CUDA_CASE(S, D, name)                                               \
  if (s == (S) && d == (D)) return sp_cuda_launch_##name;
  SP_CUDA_CASE(SP_FLOAT32, SP_BFLOAT16, f32_to_bf16)
  SP_CUDA_CASE(SP_BFLOAT16, SP_FLOAT32, bf16_to_f32)
  SP_CUDA_CASE(SP_FLOAT32, SP_FLOAT16, f32_to_f16)
  SP_CUDA_CASE(SP_FLOAT16, SP_FLOAT32, f16_to_f32)
  SP_CUDA_CASE(SP_FLOAT64, SP_FLOAT32, f64_to_f32)
  SP_CUDA_CASE(SP_FLOAT64, SP_BFLOAT16, f64_to_bf16)
  SP_CUDA_CASE(SP_FLOAT64, SP_FLOAT16, f64_to_f16)
  SP_CUDA_CASE(SP_FLOAT32, SP_FLOAT64, f32_to_f64)
  SP_CUDA_CASE(SP_BFLOAT16, SP_FLOAT64, bf16_to_f64)
  SP_CUDA_CASE(SP_FLOAT16, SP_FLOAT64, f16_to_f64)
  SP_CUDA_CASE(SP_BFLOAT16, SP_FLOAT16, bf16_to_f16)
  SP_CUDA_CASE(SP_FLOAT16, SP_BFLOAT16, f16_to_bf16)
#undef SP_CUDA_CASE
  return NULL;
}

int sp_cuda_report(int err, const char *expr, const char *file, int line) {
  cudaError_t e = (cudaError_t)err;
  fprintf(stderr, "%s:%d: %s: CUDA error %s (%s)\n", file, line, expr,
          cudaGetErrorName(e), cudaGetErrorString(e));
  return SP_ECUDA;
}

int sp_cuda_device_count(int *n) {
  if (n == NULL) return SP_EINVAL;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  *n = 0;
  if (e == cudaSuccess) {
    *n = count;
    return 0;
  }
  /* Clear the runtime's last-error slot so a later unrelated check does not
   * trip over this expected failure. */
  (void)cudaGetLastError();
  switch (e) {
  case cudaErrorNoDevice:           /* driver loaded, no GPU */
  case cudaErrorInsufficientDriver: /* no driver at all, or too old */
  case cudaErrorStubLibrary:        /* linked against the toolkit's stub */
    return 0;
  default:
    return sp_cuda_report(e, "cudaGetDeviceCount", __FILE__, __LINE__);
  }
}

int sp_cuda_cast(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
                 size_t n, void *stream) {
  if (!sp_dtype_is_floating(src_t) || !sp_dtype_is_floating(dst_t))
    return SP_EINVAL;
  if (n == 0) return 0;
  if (dst == NULL || src == NULL) return SP_EINVAL;
  cudaStream_t st = (cudaStream_t)stream;
  if (src_t == dst_t) {
    if (dst != src)
      SP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sp_dtype_size(src_t),
                                    cudaMemcpyDeviceToDevice, st));
    return 0;
  }
  sp_cuda_launch_fn launch = sp_cuda_pick(src_t, dst_t);
  if (launch == NULL) return SP_EINVAL;

  /* A few resident blocks per SM saturate memory; beyond that the
   * grid-stride loop does the rest with fewer block launches. */
  int dev = 0, sms = 0;
  SP_CUDA_CHECK(cudaGetDevice(&dev));
  SP_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  unsigned max_blocks = (unsigned)(sms > 0 ? sms : 1) * 8u;
  launch(dst, src, n, max_blocks, st);
  SP_CUDA_CHECK(cudaGetLastError());
  return 0;
}
