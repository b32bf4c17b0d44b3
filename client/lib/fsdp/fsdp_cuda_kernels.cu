/* The FSDP runtime's small kernels (cuda_internal.h), each beside the CPU
 * code it must agree with bit for bit (fsdp_mem_host.c: scale_div,
 * host_acc_div, host_scale, sp_fsdp_sqsum_ref, host_sgd, host_adamw).
 * Element loads and stores are common/cast/cast_scalar.h's, as the CPU's are;
 * arithmetic uses the explicitly rounded intrinsics (__ddiv_rn, __dmul_rn,
 * __dadd_rn, __dsub_rn, __dsqrt_rn, __double2float_rn) so that nvcc cannot
 * contract a multiply and an add into an FMA, which the ISO C build of the
 * host code never does either. Only NaN payloads may differ (GPU arithmetic returns the
 * canonical NaN); a NaN stays a NaN.
 *
 * Written in the C subset of CUDA C++, like common/cast/cast_cuda.cu. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cast/cast_scalar.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_grid.h"
#include "cuda_internal.h"
#include "fsdp_internal.h"

/* fsdp_mem_host.c scale_div: float32 (float)((double)x / div); float64 x / div;
 * bfloat16/float16 widened to float32, the same float32 step, rounded back
 * with sp_cast's RNE. */
__global__ void k_fsdp_scale_div(void *buf, int dt, size_t n, double div) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {
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

/* fsdp_mem_host.c host_acc_div, after the quotient (k_fsdp_scale_div):
 * dst = rne_dt(dst + rne_dt(src)) */
__global__ void k_fsdp_acc(void *dst, int dt, const void *src, int st,
                           size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {
    uint64_t tmp;
    sp_elem_store_f64(&tmp, dt, 0, sp_elem_load_f64(src, st, i));
    double v = sp_elem_load_f64(&tmp, dt, 0);
    sp_elem_store_f64(dst, dt, i, __dadd_rn(sp_elem_load_f64(dst, dt, i), v));
  }
}

/* fsdp_mem_host.c host_scale: g = rne(g * k) */
__global__ void k_fsdp_scale(void *g, int gdt, size_t n, double k) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    sp_elem_store_f64(g, gdt, i, __dmul_rn(sp_elem_load_f64(g, gdt, i), k));
}

/* sp_fsdp_sqsum_ref's order: block b takes chunks b, b + grid, ...;
 * thread t sums its lane in order, then the shared-memory tree */
__global__ void k_fsdp_sqsum_chunks(const void *g, int gdt, size_t n,
                                    double *partial) {
  __shared__ double lane[SP_FSDP_SQ_LANES];
  size_t chunks = n / SP_FSDP_SQ_CHUNK + (n % SP_FSDP_SQ_CHUNK != 0);
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    size_t base = c * SP_FSDP_SQ_CHUNK;
    double acc = 0.0;
    for (size_t j = 0; j < SP_FSDP_SQ_CHUNK; j += SP_FSDP_SQ_LANES) {
      size_t i = base + j + threadIdx.x;
      if (i < n) {
        double v = sp_elem_load_f64(g, gdt, i);
        acc = __dadd_rn(acc, __dmul_rn(v, v));
      }
    }
    lane[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = SP_FSDP_SQ_LANES / 2; s > 0; s /= 2) {
      if (threadIdx.x < s)
        lane[threadIdx.x] = __dadd_rn(lane[threadIdx.x], lane[threadIdx.x + s]);
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[c] = lane[0];
    __syncthreads(); /* lane[] is reused by the next chunk */
  }
}

/* the chunk sums in chunk order: one thread */
__global__ void k_fsdp_sqsum_total(const double *partial, size_t chunks,
                                   double *out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double acc = 0.0;
  for (size_t c = 0; c < chunks; c++) acc = __dadd_rn(acc, partial[c]);
  out[0] = acc;
}

/* fsdp_mem_host.c host_sgd */
__global__ void k_fsdp_sgd(void *p, int pdt, const void *g, int gdt, float *buf,
                           size_t n, double lr, double momentum, double wd) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {
    double pv = sp_elem_load_f64(p, pdt, i);
    double gv = sp_elem_load_f64(g, gdt, i);
    if (wd != 0) gv = __dadd_rn(gv, __dmul_rn(wd, pv));
    if (buf) {
      sp_elem_store_f64(buf, SP_FLOAT32, i,
                        __dadd_rn(__dmul_rn(momentum, (double)buf[i]), gv));
      gv = (double)buf[i];
    }
    sp_elem_store_f64(p, pdt, i, __dsub_rn(pv, __dmul_rn(lr, gv)));
  }
}

/* fsdp_mem_host.c host_adamw */
__global__ void k_fsdp_adamw(void *p, int pdt, const void *g, int gdt, float *m,
                             float *v, size_t n, sp_fsdp_adamw_args a) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {
    double pv = sp_elem_load_f64(p, pdt, i);
    double gv = sp_elem_load_f64(g, gdt, i);
    pv = __dsub_rn(pv, __dmul_rn(a.lrwd, pv));
    sp_elem_store_f64(
        m, SP_FLOAT32, i,
        __dadd_rn(__dmul_rn(a.beta1, (double)m[i]), __dmul_rn(a.omb1, gv)));
    sp_elem_store_f64(v, SP_FLOAT32, i,
                      __dadd_rn(__dmul_rn(a.beta2, (double)v[i]),
                                __dmul_rn(a.omb2, __dmul_rn(gv, gv))));
    double mh = __ddiv_rn((double)m[i], a.bc1);
    double vh = __ddiv_rn((double)v[i], a.bc2);
    double step =
        __ddiv_rn(__dmul_rn(a.lr, mh), __dadd_rn(__dsqrt_rn(vh), a.eps));
    sp_elem_store_f64(p, pdt, i, __dsub_rn(pv, step));
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
    return sp_diag_set(d, SP_EINVAL,
                       "scale_div: %s buffer %p (floating, "
                       "element-aligned expected)",
                       sp_dtype_name(dt), buf);
  k_fsdp_scale_div<<<sp_grid_blocks(n), SP_GRID_THREADS, 0,
                     (cudaStream_t)stream>>>(buf, (int)dt, n, div);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

static int check_floats(const char *what, const void *a, sp_dtype adt,
                        const void *b, sp_dtype bdt, sp_diag *d) {
  if (!a || !float_dtype(adt) || !aligned(a, adt) ||
      (b && (!float_dtype(bdt) || !aligned(b, bdt))))
    return sp_diag_set(d, SP_EINVAL,
                       "%s: %s %p, %s %p (floating, "
                       "element-aligned expected)",
                       what, sp_dtype_name(adt), a,
                       b ? sp_dtype_name(bdt) : "-", b);
  return 0;
}

extern "C" int sp_fsdp_cuda_acc(void *dst, sp_dtype dt, const void *src,
                                sp_dtype st, size_t n, void *stream,
                                sp_diag *d) {
  if (n == 0) return 0;
  int rc = check_floats("gradient accumulation", dst, dt, src, st, d);
  if (rc < 0) return rc;
  k_fsdp_acc<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, (cudaStream_t)stream>>>(
      dst, (int)dt, src, (int)st, n);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

extern "C" int sp_fsdp_cuda_scale(void *g, sp_dtype gdt, size_t n, double k,
                                  void *stream, sp_diag *d) {
  if (n == 0) return 0;
  int rc = check_floats("gradient scaling", g, gdt, NULL, gdt, d);
  if (rc < 0) return rc;
  k_fsdp_scale<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, (cudaStream_t)stream>>>(
      g, (int)gdt, n, k);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

extern "C" int sp_fsdp_cuda_sqsum(const void *g, sp_dtype gdt, size_t n,
                                  double *partial, double *out, void *stream,
                                  sp_diag *d) {
  int rc = check_floats("gradient norm", g, gdt, NULL, gdt, d);
  if (rc < 0) return rc;
  if (!partial || !out)
    return sp_diag_set(d, SP_EINVAL, "gradient norm: no scratch");
  size_t chunks = sp_fsdp_sqsum_chunks(n);
  cudaStream_t s = (cudaStream_t)stream;
  if (chunks) {
    /* one block a chunk, up to the cap (blocks loop over the rest) */
    unsigned blocks =
        chunks < SP_GRID_MAX_BLOCKS ? (unsigned)chunks : SP_GRID_MAX_BLOCKS;
    k_fsdp_sqsum_chunks<<<blocks, SP_FSDP_SQ_LANES, 0, s>>>(g, (int)gdt, n,
                                                            partial);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  k_fsdp_sqsum_total<<<1, 1, 0, s>>>(partial, chunks, out);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

extern "C" int sp_fsdp_cuda_sgd(void *p, sp_dtype pdt, const void *g,
                                sp_dtype gdt, float *buf, size_t n, double lr,
                                double momentum, double wd, void *stream,
                                sp_diag *d) {
  if (n == 0) return 0;
  int rc = check_floats("SGD", p, pdt, g, gdt, d);
  if (rc < 0) return rc;
  k_fsdp_sgd<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, (cudaStream_t)stream>>>(
      p, (int)pdt, g, (int)gdt, buf, n, lr, momentum, wd);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

extern "C" int sp_fsdp_cuda_adamw(void *p, sp_dtype pdt, const void *g,
                                  sp_dtype gdt, float *m, float *v, size_t n,
                                  const sp_fsdp_adamw_args *a, void *stream,
                                  sp_diag *d) {
  if (n == 0) return 0;
  int rc = check_floats("AdamW", p, pdt, g, gdt, d);
  if (rc < 0) return rc;
  if (!m || !v || !a) return sp_diag_set(d, SP_EINVAL, "AdamW: no moments");
  k_fsdp_adamw<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, (cudaStream_t)stream>>>(
      p, (int)pdt, g, (int)gdt, m, v, n, *a);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}
