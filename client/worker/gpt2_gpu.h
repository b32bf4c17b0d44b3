/* The GPT-2 kernels of gpt2_cpu.h on a GPU: each function here is the
 * CPU function of the same name (sp_gpt2_cpu_X -> sp_gpt2_gpu_X) on device
 * arrays, enqueued on the stream of its sp_gpt2_dev context, and returns 0 or
 * SP_ECUDA (the failing call, file and line in d) at once: nothing waits for
 * the kernels. Row-major float32, the CPU's argument order and meaning,
 * except where said.
 *
 * How each matches its CPU function (tests/test_gpt2_cuda.c holds them to
 * it):
 *   - bit for bit: the embeddings and their gradients, GELU and its
 *     backward, the residual add, the roundings, the cross-entropy's
 *     backward, the bias and LayerNorm parameter gradients (column sums in
 *     row order, one thread a column), the gradient accumulation: the same
 *     element definitions (gpt2_elem.h) in the same order;
 *   - within a bound: cuBLAS products (another summation order; float32
 *     in and out, CUBLAS_COMPUTE_32F, never TF32), and the row reductions
 *     of LayerNorm, the attention's softmax and the cross-entropy, which sum
 *     a row in a tree over one thread block instead of in index order
 *     (CUDA's expf is within 2 ulp where glibc's is correctly rounded).
 *
 * gpt2_cuda.c's kernel table (gpt2_step.h) holds these functions as they
 * are, but for the cross-entropy's forward, whose sum it reads back. Only
 * in a CUDA build (gpt2_cuda.h is what the trainer uses; it has a stub).
 * Sizes are the caller's to check, as for the CPU functions: every count
 * fits an int. */
#ifndef SP_GPT2_GPU_H
#define SP_GPT2_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "cast/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kernel table's state (gpt2_step.h) on a GPU: a stream (cudaStream_t;
 * NULL: the legacy default stream) and a cuBLAS handle bound to it, on the
 * calling thread's current device. Declared again here, as C11 allows, so
 * that the kernels need not see the driver. */
typedef struct sp_gpt2_dev sp_gpt2_dev;
int sp_gpt2_gpu_new(void *stream, sp_gpt2_dev **out, sp_diag *d);
/* Waits for the stream, then frees. NULL is fine. */
void sp_gpt2_gpu_free(sp_gpt2_dev *k);
void *sp_gpt2_gpu_stream(const sp_gpt2_dev *k);

int sp_gpt2_gpu_matmul_fwd(sp_gpt2_dev *k, float *out, const float *inp,
                           const float *w, const float *b, int N, int IC,
                           int OC, sp_diag *d);
int sp_gpt2_gpu_matmul_bwd(sp_gpt2_dev *k, float *dinp, float *dw, float *db,
                           const float *dout, const float *inp, const float *w,
                           int N, int IC, int OC, int acc, sp_diag *d);
int sp_gpt2_gpu_logits_fwd(sp_gpt2_dev *k, float *logits, const float *x,
                           const float *wte, int N, int C, int V, sp_diag *d);
int sp_gpt2_gpu_logits_bwd(sp_gpt2_dev *k, float *dx, float *dwte,
                           const float *dlogits, const float *x,
                           const float *wte, int N, int C, int V, int acc,
                           sp_diag *d);
int sp_gpt2_gpu_layernorm_fwd(sp_gpt2_dev *k, float *out, float *mean,
                              float *rstd, const float *inp, const float *w,
                              const float *b, int N, int C, sp_diag *d);
int sp_gpt2_gpu_layernorm_bwd(sp_gpt2_dev *k, float *dinp, float *dw, float *db,
                              const float *dout, const float *inp,
                              const float *w, const float *mean,
                              const float *rstd, int N, int C, sp_diag *d);
/* As the CPU's; att [B, NH, T, T]; allow [T, T] or NULL. */
int sp_gpt2_gpu_attention_fwd(sp_gpt2_dev *k, float *out, float *att,
                              const float *qkv, const uint8_t *allow, int B,
                              int T, int C, int NH, sp_diag *d);
/* datt: NH*T*T floats of scratch (the CPU's takes T*T: the GPU does one
 * sequence's heads at once). */
int sp_gpt2_gpu_attention_bwd(sp_gpt2_dev *k, float *dqkv, float *datt,
                              const float *dout, const float *qkv,
                              const float *att, int B, int T, int C, int NH,
                              sp_diag *d);
int sp_gpt2_gpu_gelu_fwd(sp_gpt2_dev *k, float *out, const float *inp, size_t n,
                         sp_diag *d);
int sp_gpt2_gpu_gelu_bwd(sp_gpt2_dev *k, float *dinp, const float *inp,
                         const float *dout, size_t n, sp_diag *d);
/* As the CPU's, but the sum stays on the device: rows[i] gets row i's
 * -log softmax[tgt] (double), total[0] their sum in row order (one
 * thread, so it does not depend on the launch). */
int sp_gpt2_gpu_softmax_xent_fwd(sp_gpt2_dev *k, float *probs,
                                 const int32_t *tgt, int N, int V, double *rows,
                                 double *total, sp_diag *d);
int sp_gpt2_gpu_softmax_xent_bwd(sp_gpt2_dev *k, float *probs,
                                 const int32_t *tgt, int N, int V, float scale,
                                 sp_diag *d);
int sp_gpt2_gpu_embed_fwd(sp_gpt2_dev *k, float *x, const int32_t *tok,
                          const float *wte, const float *wpe, int N, int T,
                          int C, sp_diag *d);
int sp_gpt2_gpu_wte_bwd(sp_gpt2_dev *k, float *dwte, const float *dx,
                        const int32_t *tok, int N, int C, int V, sp_diag *d);
int sp_gpt2_gpu_wpe_bwd(sp_gpt2_dev *k, float *dwpe, const float *dx, int N,
                        int T, int C, int ctx, sp_diag *d);
int sp_gpt2_gpu_add(sp_gpt2_dev *k, float *y, const float *a, const float *b,
                    size_t n, sp_diag *d);
int sp_gpt2_gpu_round(sp_gpt2_dev *k, float *v, size_t n, sp_dtype dt,
                      sp_diag *d);

/* gpt2.c's host_grad_add: dst (n elements of dt, a floating dtype) += g, the
 * sum in double rounded once to dt. */
int sp_gpt2_gpu_grad_add(sp_gpt2_dev *k, void *dst, sp_dtype dt, const float *g,
                         size_t n, sp_diag *d);
/* gpt2.c's host_mask: allow[t * T + u] = element t * ctx + u of the
 * attn.bias buffer (dtype dt) is nonzero (floating: != 0.0; otherwise any
 * nonzero byte), for t, u < T. */
int sp_gpt2_gpu_mask(sp_gpt2_dev *k, uint8_t *allow, const void *buf,
                     sp_dtype dt, int T, int ctx, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
