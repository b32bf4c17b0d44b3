/* The client's CUDA plumbing: checking macros that turn a failed CUDA or
 * cuBLAS call into an SP_E* code with the file, line and call in an
 * sp_diag, and the launchers of the runtime's small kernels
 * (fsdp_cuda_kernels.cu). Includable from C without CUDA headers; only
 * built with CUDA (SHARDPLANE_HAVE_CUDA).
 *
 * common/cast/cast_cuda.h's SP_CUDA_CHECK logs to stderr and returns SP_ECUDA;
 * these variants fill the caller's sp_diag instead, so the message reaches
 * whoever reports the failure (a worker prints it naming its rank). Neither
 * exits: library code returns errors. */
#ifndef SP_CUDA_INTERNAL_H
#define SP_CUDA_INTERNAL_H

#include <stddef.h>

#include "cast/dtype.h"
#include "base/sp_error.h"
#include "shardplane/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "file:line: call: CUDA error NAME (description)" into d; returns
 * SP_ECUDA. err is a cudaError_t. Also clears the runtime's sticky
 * last-error slot for non-sticky errors, so the next check does not trip
 * over this one. */
int sp_cuda_diag(sp_diag *d, int err, const char *expr, const char *file,
                 int line);
/* Same for a cublasStatus_t: "cuBLAS error NAME (description)". */
int sp_cublas_diag(sp_diag *d, int status, const char *expr, const char *file,
                   int line);

/* Evaluates a CUDA runtime call (or anything returning a cudaError_t);
 * on failure fills d and returns SP_ECUDA from the enclosing function. */
#define SP_CUDA_CHECK_D(d, call)                                               \
  do {                                                                         \
    int sp_cu_err_ = (int)(call);                                              \
    if (sp_cu_err_ != 0)                                                       \
      return sp_cuda_diag((d), sp_cu_err_, #call, __FILE__, __LINE__);         \
  } while (0)

/* Same for cuBLAS calls (cublasStatus_t); returns SP_ECUDA. */
#define SP_CUBLAS_CHECK_D(d, call)                                             \
  do {                                                                         \
    int sp_cb_st_ = (int)(call);                                               \
    if (sp_cb_st_ != 0)                                                        \
      return sp_cublas_diag((d), sp_cb_st_, #call, __FILE__, __LINE__);       \
  } while (0)

/* After a kernel launch: SP_CUDA_CHECK_D(d, cudaGetLastError()) reports a
 * failed launch; faults during the run surface at the next synchronizing
 * call on the stream, which is checked as well. */

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
int sp_fsdp_cuda_scale(void *g, sp_dtype gdt, size_t n, double k,
                       void *stream, sp_diag *d);
int sp_fsdp_cuda_sqsum(const void *g, sp_dtype gdt, size_t n,
                       double *partial, double *out, void *stream,
                       sp_diag *d);
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
