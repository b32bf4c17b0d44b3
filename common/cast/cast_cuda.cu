/* CUDA cast kernels, next to their CPU reference: every element goes
 * through the cast_scalar.h function the CPU scalar path uses, so the two
 * agree bit for bit by construction and the GPU test only has to prove the
 * plumbing (indexing, vector packing, heads and tails) over all inputs.
 *
 * Written in the C subset of CUDA C++ (macros instead of templates) so it
 * reads like the rest of common/.
 *
 * Kernels per operation (a plain cast of one dtype pair, or a cast with a
 * divide), chosen per call by pointer alignment:
 *   - vec:  some element index h < 8 makes both addresses 16-byte aligned
 *           (h = 0 for every cudaMalloc result). Each thread moves 8
 *           elements with 16-byte loads and stores, which is what lets a
 *           memory-bound cast approach copy bandwidth; loads and stores
 *           carry the streaming (evict-first) hint because a cast touches
 *           each byte once. The h head elements and the (n - h) % 8 tail are
 *           done one by one by the first threads of the same launch.
 *   - elem: pointers aligned to their element sizes; one element a thread.
 *   - byte: anything else (a tensor view at an odd byte offset); typed
 *           loads would fault there, so elements are assembled bytewise.
 *           Plain casts only: the divide forms require element alignment.
 * All are grid-stride loops, so the grid can be capped at a few blocks per
 * SM regardless of n.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cast_cuda.h"
#include "cast_scalar.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_grid.h"

#define SP_CUDA_VEC 8 /* elements per thread in the vec kernels */

/* ---- element operations -----------------------------------------------
 * Every operation has the signature DT op(ST x, double k); plain casts
 * ignore k. Bit patterns travel as unsigned integers of the element size. */

__device__ __forceinline__ uint16_t sp_id16(uint16_t x) { return x; }
__device__ __forceinline__ uint32_t sp_id32(uint32_t x) { return x; }
__device__ __forceinline__ uint64_t sp_id64(uint64_t x) { return x; }

#define SP_CUDA_PLAIN_OP(name, ST, DT, FN)                     \
  __device__ __forceinline__ DT sp_op_##name(ST x, double k) { \
    (void)k;                                                   \
    return FN(x);                                              \
  }

SP_CUDA_PLAIN_OP(f32_to_bf16, uint32_t, uint16_t, sp_f32_to_bf16_bits)
SP_CUDA_PLAIN_OP(bf16_to_f32, uint16_t, uint32_t, sp_bf16_to_f32_bits)
SP_CUDA_PLAIN_OP(f32_to_f16, uint32_t, uint16_t, sp_f32_to_f16_bits)
SP_CUDA_PLAIN_OP(f16_to_f32, uint16_t, uint32_t, sp_f16_to_f32_bits)
SP_CUDA_PLAIN_OP(f64_to_f32, uint64_t, uint32_t, sp_f64_to_f32_bits)
SP_CUDA_PLAIN_OP(f64_to_bf16, uint64_t, uint16_t, sp_f64_to_bf16_bits)
SP_CUDA_PLAIN_OP(f64_to_f16, uint64_t, uint16_t, sp_f64_to_f16_bits)
SP_CUDA_PLAIN_OP(f32_to_f64, uint32_t, uint64_t, sp_f32_to_f64_bits)
SP_CUDA_PLAIN_OP(bf16_to_f64, uint16_t, uint64_t, sp_bf16_to_f64_bits)
SP_CUDA_PLAIN_OP(f16_to_f64, uint16_t, uint64_t, sp_f16_to_f64_bits)
SP_CUDA_PLAIN_OP(bf16_to_f16, uint16_t, uint16_t, sp_bf16_to_f16_bits)
SP_CUDA_PLAIN_OP(f16_to_bf16, uint16_t, uint16_t, sp_f16_to_bf16_bits)

/* The quotient x / k in x's own dtype, exactly as
 * client/lib/fsdp/fsdp_mem_host.c's scale_div computes it on the CPU (see
 * sp_cuda_cast_div in cast_cuda.h).
 * Widening and narrowing use the integer cast_scalar.h functions, so the
 * only floating-point instruction is the IEEE double division, correctly
 * rounded on the GPU as on x86-64 (no FTZ: double division never flushes).
 * A NaN never reaches the division: x86-64 would return it quieted with
 * its payload, the GPU a canonical NaN, so it is quieted here in integer
 * code, matching the CPU. */
__device__ __forceinline__ uint64_t sp_div_f64(uint64_t x, double k) {
  if ((x & SP_F64_ABS_MASK) > SP_F64_INF) return x | SP_F64_QUIET;
  return sp_f64_to_bits(__ddiv_rn(sp_f64_from_bits(x), k));
}

__device__ __forceinline__ uint32_t sp_div_f32(uint32_t x, double k) {
  if ((x & SP_F32_ABS_MASK) > SP_F32_INF) return x | SP_F32_QUIET;
  double q = __ddiv_rn(sp_f64_from_bits(sp_f32_to_f64_bits(x)), k);
  return sp_f64_to_f32_bits(sp_f64_to_bits(q));
}

/* 16-bit: widen to float32 (exact), divide in double, round to float32,
 * then to the 16-bit dtype: the CPU runtime's sequence, step by step. */
__device__ __forceinline__ uint16_t sp_div_bf16(uint16_t x, double k) {
  if ((x & 0x7FFFu) > 0x7F80u) return (uint16_t)(x | 0x0040u);
  uint64_t w = sp_f32_to_f64_bits(sp_bf16_to_f32_bits(x));
  double qd = __ddiv_rn(sp_f64_from_bits(w), k);
  return sp_f32_to_bf16_bits(sp_f64_to_f32_bits(sp_f64_to_bits(qd)));
}

__device__ __forceinline__ uint16_t sp_div_f16(uint16_t x, double k) {
  if ((x & 0x7FFFu) > 0x7C00u) return (uint16_t)(x | 0x0200u);
  uint64_t w = sp_f32_to_f64_bits(sp_f16_to_f32_bits(x));
  double qd = __ddiv_rn(sp_f64_from_bits(w), k);
  return sp_f32_to_f16_bits(sp_f64_to_f32_bits(sp_f64_to_bits(qd)));
}

/* Divide in the source dtype, then cast to the destination dtype. */
#define SP_CUDA_DIV_OP(name, ST, DT, DIV, CAST)                \
  __device__ __forceinline__ DT sp_op_##name(ST x, double k) { \
    return CAST(DIV(x, k));                                    \
  }

SP_CUDA_DIV_OP(div_f64_f64, uint64_t, uint64_t, sp_div_f64, sp_id64)
SP_CUDA_DIV_OP(div_f64_f32, uint64_t, uint32_t, sp_div_f64, sp_f64_to_f32_bits)
SP_CUDA_DIV_OP(div_f64_f16, uint64_t, uint16_t, sp_div_f64, sp_f64_to_f16_bits)
SP_CUDA_DIV_OP(div_f64_bf16, uint64_t, uint16_t, sp_div_f64,
               sp_f64_to_bf16_bits)
SP_CUDA_DIV_OP(div_f32_f64, uint32_t, uint64_t, sp_div_f32, sp_f32_to_f64_bits)
SP_CUDA_DIV_OP(div_f32_f32, uint32_t, uint32_t, sp_div_f32, sp_id32)
SP_CUDA_DIV_OP(div_f32_f16, uint32_t, uint16_t, sp_div_f32, sp_f32_to_f16_bits)
SP_CUDA_DIV_OP(div_f32_bf16, uint32_t, uint16_t, sp_div_f32,
               sp_f32_to_bf16_bits)
SP_CUDA_DIV_OP(div_f16_f64, uint16_t, uint64_t, sp_div_f16, sp_f16_to_f64_bits)
SP_CUDA_DIV_OP(div_f16_f32, uint16_t, uint32_t, sp_div_f16, sp_f16_to_f32_bits)
SP_CUDA_DIV_OP(div_f16_f16, uint16_t, uint16_t, sp_div_f16, sp_id16)
SP_CUDA_DIV_OP(div_f16_bf16, uint16_t, uint16_t, sp_div_f16,
               sp_f16_to_bf16_bits)
SP_CUDA_DIV_OP(div_bf16_f64, uint16_t, uint64_t, sp_div_bf16,
               sp_bf16_to_f64_bits)
SP_CUDA_DIV_OP(div_bf16_f32, uint16_t, uint32_t, sp_div_bf16,
               sp_bf16_to_f32_bits)
SP_CUDA_DIV_OP(div_bf16_f16, uint16_t, uint16_t, sp_div_bf16,
               sp_bf16_to_f16_bits)
SP_CUDA_DIV_OP(div_bf16_bf16, uint16_t, uint16_t, sp_div_bf16, sp_id16)

/* ---- kernels ------------------------------------------------------------- */

/* vec and elem kernels and their launcher for one operation. The launcher
 * returns 0 after a launch, or -1 when a pointer is not aligned to its
 * element size (the caller then uses the byte kernel or refuses). */
#define SP_CUDA_KERNELS(name, ST, DT)                                          \
  __global__ void sp_cuda_k_vec_##name(DT *dst, const ST *src, size_t head,    \
                                       size_t nvec, size_t tail, double k) {   \
    enum {                                                                     \
      SQ = (int)(sizeof(ST) * SP_CUDA_VEC / 16),                               \
      DQ = (int)(sizeof(DT) * SP_CUDA_VEC / 16)                                \
    };                                                                         \
    const ST *vs = src + head;                                                 \
    DT *vd = dst + head;                                                       \
    for (size_t v = SP_GRID_TID(); v < nvec; v += SP_GRID_STRIDE()) {          \
      union {                                                                  \
        uint4 q[SQ];                                                           \
        ST e[SP_CUDA_VEC];                                                     \
      } in;                                                                    \
      union {                                                                  \
        uint4 q[DQ];                                                           \
        DT e[SP_CUDA_VEC];                                                     \
      } out;                                                                   \
      const uint4 *s = (const uint4 *)(vs + v * SP_CUDA_VEC);                  \
      uint4 *d = (uint4 *)(vd + v * SP_CUDA_VEC);                              \
      _Pragma("unroll") for (int j = 0; j < SQ; j++) in.q[j] = __ldcs(s + j);  \
      _Pragma("unroll") for (int j = 0; j < SP_CUDA_VEC; j++) out.e[j] =       \
          sp_op_##name(in.e[j], k);                                            \
      _Pragma("unroll") for (int j = 0; j < DQ; j++) __stcs(d + j, out.q[j]);  \
    }                                                                          \
    size_t t = SP_GRID_TID();                                                  \
    if (t < head) dst[t] = sp_op_##name(src[t], k);                            \
    if (t < tail) {                                                            \
      size_t i = head + nvec * SP_CUDA_VEC + t;                                \
      dst[i] = sp_op_##name(src[i], k);                                        \
    }                                                                          \
  }                                                                            \
  __global__ void sp_cuda_k_elem_##name(DT *dst, const ST *src, size_t n,      \
                                        double k) {                            \
    for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())               \
      dst[i] = sp_op_##name(src[i], k);                                        \
  }                                                                            \
  static int sp_cuda_launch_##name(void *dst, const void *src, size_t n,       \
                                   double k, unsigned max_blocks,              \
                                   cudaStream_t st) {                          \
    uintptr_t da = (uintptr_t)dst, sa = (uintptr_t)src;                        \
    if (da % sizeof(DT) != 0 || sa % sizeof(ST) != 0) return -1;               \
    /* Both alignment conditions repeat with a period of at most 8          */ \
    /* elements (16 bytes of the smallest element), so h < 8 finds one     */  \
    /* if any exists.                                                       */ \
    size_t head = SP_CUDA_VEC;                                                 \
    for (size_t h = 0; h < SP_CUDA_VEC && h <= n; h++)                         \
      if ((da + h * sizeof(DT)) % 16 == 0 &&                                   \
          (sa + h * sizeof(ST)) % 16 == 0) {                                   \
        head = h;                                                              \
        break;                                                                 \
      }                                                                        \
    size_t work;                                                               \
    bool vec = head < SP_CUDA_VEC && n - head >= SP_CUDA_VEC;                  \
    size_t nvec = 0, tail = 0;                                                 \
    if (vec) {                                                                 \
      nvec = (n - head) / SP_CUDA_VEC;                                         \
      tail = (n - head) % SP_CUDA_VEC;                                         \
      work = nvec;                                                             \
      if (work < head) work = head;                                            \
      if (work < tail) work = tail;                                            \
    } else {                                                                   \
      work = n;                                                                \
    }                                                                          \
    unsigned blocks = sp_grid_blocks_cap(work, max_blocks);                    \
    if (vec)                                                                   \
      sp_cuda_k_vec_##name<<<blocks, SP_GRID_THREADS, 0, st>>>(                \
          (DT *)dst, (const ST *)src, head, nvec, tail, k);                    \
    else                                                                       \
      sp_cuda_k_elem_##name<<<blocks, SP_GRID_THREADS, 0, st>>>(               \
          (DT *)dst, (const ST *)src, n, k);                                   \
    return 0;                                                                  \
  }

/* The byte kernel of a plain cast, for pointers that are not even aligned
 * to their element sizes. */
#define SP_CUDA_BYTE_KERNEL(name, ST, DT)                                      \
  __global__ void sp_cuda_k_byte_##name(unsigned char *dst,                    \
                                        const unsigned char *src, size_t n) {  \
    for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {             \
      ST x;                                                                    \
      memcpy(&x, src + i * sizeof(ST), sizeof(ST));                            \
      DT y = sp_op_##name(x, 1.0);                                             \
      memcpy(dst + i * sizeof(DT), &y, sizeof(DT));                            \
    }                                                                          \
  }                                                                            \
  static void sp_cuda_launch_byte_##name(void *dst, const void *src, size_t n, \
                                         unsigned max_blocks,                  \
                                         cudaStream_t st) {                    \
    unsigned blocks = sp_grid_blocks_cap(n, max_blocks);                       \
    sp_cuda_k_byte_##name<<<blocks, SP_GRID_THREADS, 0, st>>>(                 \
        (unsigned char *)dst, (const unsigned char *)src, n);                  \
  }

#define SP_CUDA_PLAIN(name, ST, DT) \
  SP_CUDA_KERNELS(name, ST, DT)     \
  SP_CUDA_BYTE_KERNEL(name, ST, DT)

SP_CUDA_PLAIN(f32_to_bf16, uint32_t, uint16_t)
SP_CUDA_PLAIN(bf16_to_f32, uint16_t, uint32_t)
SP_CUDA_PLAIN(f32_to_f16, uint32_t, uint16_t)
SP_CUDA_PLAIN(f16_to_f32, uint16_t, uint32_t)
SP_CUDA_PLAIN(f64_to_f32, uint64_t, uint32_t)
SP_CUDA_PLAIN(f64_to_bf16, uint64_t, uint16_t)
SP_CUDA_PLAIN(f64_to_f16, uint64_t, uint16_t)
SP_CUDA_PLAIN(f32_to_f64, uint32_t, uint64_t)
SP_CUDA_PLAIN(bf16_to_f64, uint16_t, uint64_t)
SP_CUDA_PLAIN(f16_to_f64, uint16_t, uint64_t)
SP_CUDA_PLAIN(bf16_to_f16, uint16_t, uint16_t)
SP_CUDA_PLAIN(f16_to_bf16, uint16_t, uint16_t)

SP_CUDA_KERNELS(div_f64_f64, uint64_t, uint64_t)
SP_CUDA_KERNELS(div_f64_f32, uint64_t, uint32_t)
SP_CUDA_KERNELS(div_f64_f16, uint64_t, uint16_t)
SP_CUDA_KERNELS(div_f64_bf16, uint64_t, uint16_t)
SP_CUDA_KERNELS(div_f32_f64, uint32_t, uint64_t)
SP_CUDA_KERNELS(div_f32_f32, uint32_t, uint32_t)
SP_CUDA_KERNELS(div_f32_f16, uint32_t, uint16_t)
SP_CUDA_KERNELS(div_f32_bf16, uint32_t, uint16_t)
SP_CUDA_KERNELS(div_f16_f64, uint16_t, uint64_t)
SP_CUDA_KERNELS(div_f16_f32, uint16_t, uint32_t)
SP_CUDA_KERNELS(div_f16_f16, uint16_t, uint16_t)
SP_CUDA_KERNELS(div_f16_bf16, uint16_t, uint16_t)
SP_CUDA_KERNELS(div_bf16_f64, uint16_t, uint64_t)
SP_CUDA_KERNELS(div_bf16_f32, uint16_t, uint32_t)
SP_CUDA_KERNELS(div_bf16_f16, uint16_t, uint16_t)
SP_CUDA_KERNELS(div_bf16_bf16, uint16_t, uint16_t)

/* ---- dispatch ------------------------------------------------------------ */

typedef int (*sp_cuda_launch_fn)(void *dst, const void *src, size_t n, double k,
                                 unsigned max_blocks, cudaStream_t st);
typedef void (*sp_cuda_byte_fn)(void *dst, const void *src, size_t n,
                                unsigned max_blocks, cudaStream_t st);

/* Row and column of the tables below; -1 for a non-floating dtype. */
static int sp_cuda_index(sp_dtype t) {
  switch (t) {
    case SP_FLOAT64: return 0;
    case SP_FLOAT32: return 1;
    case SP_FLOAT16: return 2;
    case SP_BFLOAT16: return 3;
    default: return -1;
  }
}

/* [source][destination]; the diagonal of the plain casts is a copy. */
static const sp_cuda_launch_fn k_plain[4][4] = {
    {NULL, sp_cuda_launch_f64_to_f32, sp_cuda_launch_f64_to_f16,
     sp_cuda_launch_f64_to_bf16},
    {sp_cuda_launch_f32_to_f64, NULL, sp_cuda_launch_f32_to_f16,
     sp_cuda_launch_f32_to_bf16},
    {sp_cuda_launch_f16_to_f64, sp_cuda_launch_f16_to_f32, NULL,
     sp_cuda_launch_f16_to_bf16},
    {sp_cuda_launch_bf16_to_f64, sp_cuda_launch_bf16_to_f32,
     sp_cuda_launch_bf16_to_f16, NULL},
};
static const sp_cuda_byte_fn k_plain_byte[4][4] = {
    {NULL, sp_cuda_launch_byte_f64_to_f32, sp_cuda_launch_byte_f64_to_f16,
     sp_cuda_launch_byte_f64_to_bf16},
    {sp_cuda_launch_byte_f32_to_f64, NULL, sp_cuda_launch_byte_f32_to_f16,
     sp_cuda_launch_byte_f32_to_bf16},
    {sp_cuda_launch_byte_f16_to_f64, sp_cuda_launch_byte_f16_to_f32, NULL,
     sp_cuda_launch_byte_f16_to_bf16},
    {sp_cuda_launch_byte_bf16_to_f64, sp_cuda_launch_byte_bf16_to_f32,
     sp_cuda_launch_byte_bf16_to_f16, NULL},
};
static const sp_cuda_launch_fn k_div[4][4] = {
    {sp_cuda_launch_div_f64_f64, sp_cuda_launch_div_f64_f32,
     sp_cuda_launch_div_f64_f16, sp_cuda_launch_div_f64_bf16},
    {sp_cuda_launch_div_f32_f64, sp_cuda_launch_div_f32_f32,
     sp_cuda_launch_div_f32_f16, sp_cuda_launch_div_f32_bf16},
    {sp_cuda_launch_div_f16_f64, sp_cuda_launch_div_f16_f32,
     sp_cuda_launch_div_f16_f16, sp_cuda_launch_div_f16_bf16},
    {sp_cuda_launch_div_bf16_f64, sp_cuda_launch_div_bf16_f32,
     sp_cuda_launch_div_bf16_f16, sp_cuda_launch_div_bf16_bf16},
};

/* ---- devices ------------------------------------------------------------- */

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
    case cudaErrorStubLibrary: /* linked against the toolkit's stub */ return 0;
    default:
      return sp_cuda_diag(NULL, e, "cudaGetDeviceCount", __FILE__, __LINE__);
  }
}

int sp_cuda_device_memory(int device, uint64_t *free_b, uint64_t *total_b,
                          sp_diag *d) {
  if (free_b == NULL || total_b == NULL || device < 0)
    return sp_diag_set(d, SP_EINVAL, "sp_cuda_device_memory: bad argument");
  size_t fr = 0, tot = 0;
  SP_CUDA_CHECK(d, cudaSetDevice(device));
  SP_CUDA_CHECK(d, cudaMemGetInfo(&fr, &tot));
  *free_b = fr;
  *total_b = tot;
  return 0;
}

/* ---- entry points -------------------------------------------------------- */

/* A few resident blocks per SM saturate memory; beyond that the grid-stride
 * loop does the rest with fewer block launches. */
static int sp_cuda_max_blocks(unsigned *out) {
  int dev = 0, sms = 0;
  SP_CUDA_CHECK(NULL, cudaGetDevice(&dev));
  SP_CUDA_CHECK(
      NULL, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  *out = (unsigned)(sms > 0 ? sms : 1) * 8u;
  return 0;
}

int sp_cuda_cast(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
                 size_t n, void *stream) {
  int si = sp_cuda_index(src_t), di = sp_cuda_index(dst_t);
  if (si < 0 || di < 0) return SP_EINVAL;
  if (n == 0) return 0;
  if (dst == NULL || src == NULL) return SP_EINVAL;
  /* 8 bytes is the largest element: the byte counts below cannot wrap. */
  if (n > SIZE_MAX / 8) return SP_EINVAL;
  cudaStream_t st = (cudaStream_t)stream;
  if (src_t == dst_t) {
    if (dst != src)
      SP_CUDA_CHECK(NULL, cudaMemcpyAsync(dst, src, n * sp_dtype_size(src_t),
                                          cudaMemcpyDeviceToDevice, st));
    return 0;
  }
  /* In place works element by element only when elements line up. */
  if (dst == src && sp_dtype_size(src_t) != sp_dtype_size(dst_t))
    return SP_EINVAL;
  unsigned max_blocks = 0;
  int rc = sp_cuda_max_blocks(&max_blocks);
  if (rc < 0) return rc;
  if (k_plain[si][di](dst, src, n, 1.0, max_blocks, st) != 0)
    k_plain_byte[si][di](dst, src, n, max_blocks, st);
  SP_CUDA_CHECK(NULL, cudaGetLastError());
  return 0;
}

int sp_cuda_cast_at(void *dst, size_t dst_off, sp_dtype dst_t, const void *src,
                    size_t src_off, sp_dtype src_t, size_t n, void *stream) {
  if (sp_cuda_index(src_t) < 0 || sp_cuda_index(dst_t) < 0) return SP_EINVAL;
  if (n == 0) return 0;
  if (dst == NULL || src == NULL) return SP_EINVAL;
  size_t ds = sp_dtype_size(dst_t), ss = sp_dtype_size(src_t);
  if (dst_off > SIZE_MAX / ds || src_off > SIZE_MAX / ss) return SP_EINVAL;
  uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if (d > UINTPTR_MAX - dst_off * ds || s > UINTPTR_MAX - src_off * ss)
    return SP_EINVAL;
  return sp_cuda_cast((unsigned char *)dst + dst_off * ds, dst_t,
                      (const unsigned char *)src + src_off * ss, src_t, n,
                      stream);
}

int sp_cuda_cast_div(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
                     size_t n, double div, void *stream) {
  int si = sp_cuda_index(src_t), di = sp_cuda_index(dst_t);
  if (si < 0 || di < 0) return SP_EINVAL;
  if (!isfinite(div) || div == 0.0) return SP_EINVAL;
  if (n == 0) return 0;
  if (dst == NULL || src == NULL) return SP_EINVAL;
  if (n > SIZE_MAX / 8) return SP_EINVAL;
  size_t ds = sp_dtype_size(dst_t), ss = sp_dtype_size(src_t);
  if ((uintptr_t)dst % ds != 0 || (uintptr_t)src % ss != 0) return SP_EINVAL;
  if (dst == src && ds != ss) return SP_EINVAL;
  /* The CPU runtime skips the division when the factor is 1. */
  if (div == 1.0) return sp_cuda_cast(dst, dst_t, src, src_t, n, stream);
  unsigned max_blocks = 0;
  int rc = sp_cuda_max_blocks(&max_blocks);
  if (rc < 0) return rc;
  if (k_div[si][di](dst, src, n, div, max_blocks, (cudaStream_t)stream) != 0)
    return SP_EINVAL; /* unreachable: alignment was checked above */
  SP_CUDA_CHECK(NULL, cudaGetLastError());
  return 0;
}
