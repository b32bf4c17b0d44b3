/* The launchers of the FSDP runtime's small kernels
 * (fsdp_cuda_kernels.cu), for its device memory ops (fsdp_cuda.c).
 * Includable from C without CUDA headers; only built with CUDA
 * (SHARDPLANE_HAVE_CUDA). A failure is SP_ECUDA filled in by
 * common/cuda/cuda_check.h. */
#ifndef SP_CUDA_INTERNAL_H
#define SP_CUDA_INTERNAL_H

#include <stddef.h>

#include "cast/dtype.h"
#include "base/sp_error.h"
#include "shardplane/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Kernels of the FSDP runtime, enqueued on `stream` (a cudaStream_t),
 * each bit for bit its CPU reference in fsdp_mem_host.c (the memory ops
 * of fsdp_internal.h say what each computes):
 * scale_div: buf[i] /= div in place (float32 and float64: the quotient in
 *   double rounded once; bfloat16 and float16: via float32);
 * acc: dst = rne_dt(dst + rne_dt(src)), the second half of acc_div;
 * scale: g = rne(g * k);
 * sqsum: *out = the sum of squares in sp_fsdp_sqsum_ref's order, through
 *   partial (sp_fsdp_sqsum_chunks(n) doubles of device memory);
 * sgd, adamw: the optimizer updates (buf NULL: no momentum).
 * All: floating dtypes, element-aligned pointers (SP_EINVAL otherwise);
 * SP_ECUDA on a failed launch. */
struct sp_fsdp_adamw_args;
int sp_fsdp_cuda_scale_div(void *buf, sp_dtype dt, size_t n, double div,
                           void *stream, sp_diag *d);
int sp_fsdp_cuda_acc(void *dst, sp_dtype dt, const void *src, sp_dtype st,
                     size_t n, void *stream, sp_diag *d);
int sp_fsdp_cuda_scale(void *g, sp_dtype gdt, size_t n, double k, void *stream,
                       sp_diag *d);
int sp_fsdp_cuda_sqsum(const void *g, sp_dtype gdt, size_t n, double *partial,
                       double *out, void *stream, sp_diag *d);
int sp_fsdp_cuda_sgd(void *p, sp_dtype pdt, const void *g, sp_dtype gdt,
                     float *buf, size_t n, double lr, double momentum,
                     double wd, void *stream, sp_diag *d);
int sp_fsdp_cuda_adamw(void *p, sp_dtype pdt, const void *g, sp_dtype gdt,
                       float *m, float *v, size_t n,
                       const struct sp_fsdp_adamw_args *a, void *stream,
                       sp_diag *d);

#ifdef __cplusplus
}
#endif

#endif
