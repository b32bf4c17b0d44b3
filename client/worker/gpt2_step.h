/* The GPT-2 step driver: the pieces of gpt2.h's step (the embeddings, a
 * block, the head, and their backward) written once over a table of
 * kernels, sp_gpt2_ops, as the runtime's sp_fsdp_mem_ops is a table of its
 * storage. The CPU (gpt2.c: host memory, gpt2_cpu.c's kernels on CBLAS)
 * and a GPU (gpt2_cuda.c: device memory, gpt2_gpu.cu's kernels on cuBLAS
 * on one stream) each implement the table; which kernel runs on which
 * arrays in which order, and where a 16-bit param dtype rounds, is here
 * only, so the two cannot drift apart.
 *
 * Internal to the worker's models: gpt2.h and gpt2_cuda.h are the API.
 * Names: sp_gpt2_step_X. What can fail returns 0 or a negative SP_E* code
 * with d filled. */
#ifndef SP_GPT2_STEP_H
#define SP_GPT2_STEP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "cast/dtype.h"
#include "gpt2.h"
#include "gpt2_acts.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a table's kernels run on: on a GPU its stream and cuBLAS handle
 * (gpt2_gpu.cu defines it); the CPU's kernels need nothing and get NULL. */
typedef struct sp_gpt2_dev sp_gpt2_dev;

/* Arrays are row-major float32 in the table's memory; the kernels are
 * gpt2_cpu.h's (arguments and meaning there), each returning 0 or an
 * error. */
typedef struct sp_gpt2_ops {
  const sp_gpt2_layout *layout; /* what its activations need */

  /* bytes of the table's memory (contents undefined), and back */
  sp_gpt2_alloc_fn alloc;
  sp_gpt2_release_fn release; /* NULL is fine */
  int (*zero)(sp_gpt2_dev *k, void *p, size_t bytes, sp_diag *d);
  /* dst = src (n elements of st) as float32, exact; fqn names the param
   * in the message */
  int (*to_f32)(sp_gpt2_dev *k, float *dst, const void *src, sp_dtype st,
                size_t n, const char *fqn, sp_diag *d);
  /* dst (n elements of dt) += g, the sum in double rounded once to dt (as
   * autograd accumulates into .grad); SP_EINVAL when dt is not floating */
  int (*grad_add)(sp_gpt2_dev *k, void *dst, sp_dtype dt, const float *g,
                  size_t n, sp_diag *d);
  /* allow[t * T + u] = element t * ctx + u of the attn.bias buffer (dtype
   * dt) is nonzero (floating: != 0.0; otherwise any nonzero byte) */
  int (*mask)(sp_gpt2_dev *k, uint8_t *allow, const void *buf, sp_dtype dt,
              int T, int ctx, sp_diag *d);

  int (*embed_fwd)(sp_gpt2_dev *k, float *x, const int32_t *tok,
                   const float *wte, const float *wpe, int N, int T, int C,
                   sp_diag *d);
  int (*layernorm_fwd)(sp_gpt2_dev *k, float *out, float *mean, float *rstd,
                       const float *inp, const float *w, const float *b, int N,
                       int C, sp_diag *d);
  int (*matmul_fwd)(sp_gpt2_dev *k, float *out, const float *inp,
                    const float *w, const float *b, int N, int IC, int OC,
                    sp_diag *d);
  int (*attention_fwd)(sp_gpt2_dev *k, float *out, float *att, const float *qkv,
                       const uint8_t *allow, int B, int T, int C, int NH,
                       sp_diag *d);
  int (*gelu_fwd)(sp_gpt2_dev *k, float *out, const float *inp, size_t n,
                  sp_diag *d);
  int (*add)(sp_gpt2_dev *k, float *y, const float *a, const float *b, size_t n,
             sp_diag *d);
  int (*round)(sp_gpt2_dev *k, float *v, size_t n, sp_dtype dt, sp_diag *d);
  int (*logits_fwd)(sp_gpt2_dev *k, float *logits, const float *x,
                    const float *wte, int N, int C, int V, sp_diag *d);
  /* *sum: the rows' losses summed, on the host once this returns (it
   * waits); rows (N doubles) and total (one) are scratch in the table's
   * memory for a table that sums there, else NULL */
  int (*softmax_xent_fwd)(sp_gpt2_dev *k, float *probs, const int32_t *tgt,
                          int N, int V, double *rows, double *total,
                          double *sum, sp_diag *d);
  int (*softmax_xent_bwd)(sp_gpt2_dev *k, float *probs, const int32_t *tgt,
                          int N, int V, float scale, sp_diag *d);
  /* dwte's sum added to it when acc, else written */
  int (*logits_bwd)(sp_gpt2_dev *k, float *dx, float *dwte,
                    const float *dlogits, const float *x, const float *wte,
                    int N, int C, int V, int acc, sp_diag *d);
  int (*layernorm_bwd)(sp_gpt2_dev *k, float *dinp, float *dw, float *db,
                       const float *dout, const float *inp, const float *w,
                       const float *mean, const float *rstd, int N, int C,
                       sp_diag *d);
  int (*matmul_bwd)(sp_gpt2_dev *k, float *dinp, float *dw, float *db,
                    const float *dout, const float *inp, const float *w, int N,
                    int IC, int OC, int acc, sp_diag *d);
  /* datt: scratch of one head's T x T, or every head's (datt_all_heads) */
  int (*attention_bwd)(sp_gpt2_dev *k, float *dqkv, float *datt,
                       const float *dout, const float *qkv, const float *att,
                       int B, int T, int C, int NH, sp_diag *d);
  int (*gelu_bwd)(sp_gpt2_dev *k, float *dinp, const float *inp,
                  const float *dout, size_t n, sp_diag *d);
  int (*wte_bwd)(sp_gpt2_dev *k, float *dwte, const float *dx,
                 const int32_t *tok, int N, int C, int V, sp_diag *d);
  /* The lookup's share added to a float32 view of wte's gradient: each
   * token's rows of dx summed in token order into scratch rows (N x C at
   * most; row_of is V ints of scratch), then each sum added to the view
   * once, as wte_bwd's V x C scratch then grad_add would; NULL when the
   * table has none (sp_gpt2_layout.wte_rows false). */
  int (*wte_bwd_rows)(sp_gpt2_dev *k, float *dwte, float *rows, int32_t *row_of,
                      const float *dx, const int32_t *tok, int N, int C, int V,
                      sp_diag *d);
  int (*wpe_bwd)(sp_gpt2_dev *k, float *dwpe, const float *dx, int N, int T,
                 int C, int ctx, sp_diag *d);
} sp_gpt2_ops;

/* One model's step on one implementation; the caller's, borrowed. */
typedef struct sp_gpt2_step {
  const sp_gpt2 *g;
  const sp_gpt2_ops *ops;
  sp_gpt2_dev *k;  /* the kernels' state (NULL on the CPU) */
  sp_gpt2_acts *a; /* sp_gpt2_acts_alloc's over ops, tok and tgt written */
} sp_gpt2_step;

/* gpt2.h's pieces, with its errors; the caller has checked its arguments
 * (not NULL, io's param and param_dtype set), the tokens and targets
 * (below V) and, for the head, denom (sp_gpt2_step_check_denom). On a GPU
 * they return once their work is enqueued, except head_forward, which
 * waits for the loss. */
int sp_gpt2_step_embed_forward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                               sp_diag *d);
int sp_gpt2_step_block_forward(const sp_gpt2_step *s, size_t l,
                               const sp_gpt2_io *io, sp_diag *d);
int sp_gpt2_step_head_forward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d);
int sp_gpt2_step_head_backward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                               double denom, sp_diag *d);
int sp_gpt2_step_block_backward(const sp_gpt2_step *s, size_t l,
                                const sp_gpt2_io *io, sp_diag *d);
int sp_gpt2_step_embed_backward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                                sp_diag *d);

/* SP_EINVAL unless denom >= 1 (the head's loss denominator). */
int sp_gpt2_step_check_denom(double denom, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
