/* The FSDP runtime's small kernels (cuda_internal.h), each beside the CPU
 * code it must agree with bit for bit (fsdp_mem_host.c: scale_div and
 * host_sgd). Conversions go through common/cast_scalar.h, as the CPU's do;
 * arithmetic uses the explicitly rounded intrinsics (__ddiv_rn, __dmul_rn,
 * __dsub_rn, __double2float_rn) so that nvcc cannot contract a multiply
 * and a subtract into an FMA, which the ISO C build of the host code never
 * does either. Only NaN payloads may differ (GPU arithmetic returns the
 * canonical NaN); a NaN stays a NaN.
 *
 * Written in the C subset of CUDA C++, like common/cast_cuda.cu. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cast/cast_scalar.h"
#include "cast/cuda_launch.h"
#include "cuda_internal.h"

/* Element i of a floating array, widened exactly to double (sp_cast's
 * widening). */
static __device__ double load_f64(const void *p, int dt, size_t i) {
  switch (dt) {
  case SP_FLOAT64:
    return ((const double *)p)[i];
  case SP_FLOAT32:
    return sp_f64_from_bits(sp_f32_to_f64_bits(((const uint32_t *)p)[i]));
  case SP_BFLOAT16:
    return sp_f64_from_bits(sp_bf16_to_f64_bits(((const uint16_t *)p)[i]));
  default: /* SP_FLOAT16 */
    return sp_f64_from_bits(sp_f16_to_f64_bits(((const uint16_t *)p)[i]));
  }
}

/* v rounded once (RNE) to dt, stored at element i (sp_cast's narrowing). */
static __device__ void store_f64(void *p, int dt, size_t i, double v) {
  uint64_t u = sp_f64_to_bits(v);
  switch (dt) {
  case SP_FLOAT64:
    ((double *)p)[i] = v;
    break;
  case SP_FLOAT32:
    ((uint32_t *)p)[i] = sp_f64_to_f32_bits(u);
    break;
  case SP_BFLOAT16:
    ((uint16_t *)p)[i] = sp_f64_to_bf16_bits(u);
    break;
  default: /* SP_FLOAT16 */
    ((uint16_t *)p)[i] = sp_f64_to_f16_bits(u);
    break;
  }
}

/* fsdp_mem_host.c scale_div: float32 (float)((double)x / div); float64 x / div;
 * bfloat16/float16 widened to float32, the same float32 step, rounded back
 * with sp_cast's RNE. */
__global__ void sp_k_scale_div(void *buf, int dt, size_t n, double div) {
  for (size_t i = SP_K_TID(); i < n; i += SP_K_STRIDE()) {
    switch (dt) {
    case SP_FLOAT64: {
      double *p = (double *)buf;
      p[i] = __ddiv_rn(p[i], div);
      break;
    }
    case SP_FLOAT32: {
      float *p = (float *)buf;
      p[i] = __double2float_rn(__ddiv_rn((double)p[i], div));
      break;
    }
    case SP_BFLOAT16: {
      uint16_t *p = (uint16_t *)buf;
      float x = sp_f32_from_bits(sp_bf16_to_f32_bits(p[i]));
      float q = __double2float_rn(__ddiv_rn((double)x, div));
      p[i] = sp_f32_to_bf16_bits(sp_f32_to_bits(q));
      break;
    }
    default: { /* SP_FLOAT16 */
      uint16_t *p = (uint16_t *)buf;
      float x = sp_f32_from_bits(sp_f16_to_f32_bits(p[i]));
      float q = __double2float_rn(__ddiv_rn((double)x, div));
      p[i] = sp_f32_to_f16_bits(sp_f32_to_bits(q));
      break;
    }
    }
  }
}

/* fsdp_mem_host.c host_sgd: p = rne(p - lr * g) in double, then g = 0. */
__global__ void sp_k_sgd(void *p, int pdt, void *g, int gdt, size_t gsize,
                         size_t n, double lr) {
  for (size_t i = SP_K_TID(); i < n; i += SP_K_STRIDE()) {
    double pv = load_f64(p, pdt, i);
    double gv = load_f64(g, gdt, i);
    store_f64(p, pdt, i, __dsub_rn(pv, __dmul_rn(lr, gv)));
    /* zero bits are +0 in every floating dtype */
    memset((unsigned char *)g + i * gsize, 0, gsize);
  }
}

static bool float_dtype(sp_dtype dt) {
  return dt == SP_FLOAT64 || dt == SP_FLOAT32 || dt == SP_BFLOAT16 ||
         dt == SP_FLOAT16;
}

static bool aligned(const void *p, sp_dtype dt) {
  return (uintptr_t)p % sp_dtype_size(dt) == 0;
}

extern "C" int sp_fsdp_cuda_scale_div(void *buf, sp_dtype dt, size_t n,
                                      double div, void *stream, sp_diag *d) {
  if (n == 0 || div == 1.0) return 0;
  if (!buf || !float_dtype(dt) || !aligned(buf, dt))
    return sp_diag_set(d, SP_EINVAL, "scale_div: %s buffer %p (floating, "
                       "element-aligned expected)", sp_dtype_name(dt), buf);
  sp_k_scale_div<<<sp_k_blocks(n), SP_K_THREADS, 0, (cudaStream_t)stream>>>(
      buf, (int)dt, n, div);
  SP_CUDA_CHECK_D(d, cudaGetLastError());
  return 0;
}

extern "C" int sp_fsdp_cuda_sgd(void *p, sp_dtype pdt, void *g, sp_dtype gdt,
                                size_t n, double lr, void *stream,
                                sp_diag *d) {
  if (n == 0) return 0;
  if (!p || !g || !float_dtype(pdt) || !float_dtype(gdt) || !aligned(p, pdt) ||
      !aligned(g, gdt))
    return sp_diag_set(d, SP_EINVAL, "sgd: %s shard %p, %s gradient %p "
                       "(floating, element-aligned expected)",
                       sp_dtype_name(pdt), p, sp_dtype_name(gdt), g);
  sp_k_sgd<<<sp_k_blocks(n), SP_K_THREADS, 0, (cudaStream_t)stream>>>(
      p, (int)pdt, g, (int)gdt, sp_dtype_size(gdt), n, lr);
  SP_CUDA_CHECK_D(d, cudaGetLastError());
  return 0;
}
