/* The check of a cuBLAS call, for the worker's models on a GPU: beside
 * common/cuda/cuda_check.h's SP_CUDA_CHECK, here because naming a
 * cublasStatus_t needs libcublas, which only the models link. Includable
 * from C without CUDA headers; cublas_check.cu is only built with CUDA. */
#ifndef SP_WORKER_CUBLAS_CHECK_H
#define SP_WORKER_CUBLAS_CHECK_H

#include "base/sp_error.h"
#include "cuda/cuda_check.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "file:line: expr: cuBLAS error NAME (description)" for a
 * cublasStatus_t status, into d; returns SP_ECUDA. */
int sp_cublas_diag(sp_diag *d, int status, const char *expr, const char *file,
                   int line);

/* Evaluates a cuBLAS call; on failure returns sp_cublas_diag's SP_ECUDA
 * from the enclosing function, which must return int. */
#define SP_CUBLAS_CHECK(d, call) SP_CUDA_CHECK_WITH(sp_cublas_diag, d, call)

#ifdef __cplusplus
}
#endif

#endif
