/* The CPU kernels of the GPT-2 model (gpt2.h), named sp_gpt2_cpu_X (their
 * GPU twins, gpt2_gpu.h, sp_gpt2_gpu_X): Conv1D products, LayerNorm,
 * causal attention, GELU and the softmax cross-entropy, each with its
 * backward. Row-major float32; products are cblas_sgemm, every other sum
 * runs over rows in index order (deterministic). Sizes are the caller's to
 * check: every count here fits an int (gpt2.c bounds them at 2^31). */
#ifndef SP_GPT2_CPU_H
#define SP_GPT2_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"

/* out[N, OC] = inp[N, IC] w[IC, OC] + b[OC] (b may be NULL). */
void sp_gpt2_cpu_matmul_fwd(float *out, const float *inp, const float *w,
                            const float *b, int N, int IC, int OC);
/* dinp[N, IC] = dout w^T (dinp NULL: skipped, overwritten), then
 * dw[IC, OC] = inp^T dout and db[OC] = the column sums of dout (db may be
 * NULL): overwritten when acc is 0, added to when it is 1 (a gradient
 * view's accumulation, in float32). */
void sp_gpt2_cpu_matmul_bwd(float *dinp, float *dw, float *db,
                            const float *dout, const float *inp, const float *w,
                            int N, int IC, int OC, int acc);
/* The tied head: logits[N, V] = x[N, C] wte[V, C]^T. */
void sp_gpt2_cpu_logits_fwd(float *logits, const float *x, const float *wte,
                            int N, int C, int V);
/* dx[N, C] = dlogits wte, overwritten; dwte[V, C] = dlogits^T x (NULL:
 * none), overwritten when acc is 0, added to when it is 1. */
void sp_gpt2_cpu_logits_bwd(float *dx, float *dwte, const float *dlogits,
                            const float *x, const float *wte, int N, int C,
                            int V, int acc);
/* LayerNorm over C per row, eps 1e-5, biased variance; mean and rstd per
 * row kept for backward. */
void sp_gpt2_cpu_layernorm_fwd(float *out, float *mean, float *rstd,
                               const float *inp, const float *w, const float *b,
                               int N, int C);
/* dinp += the input gradient; dw, db overwritten. */
void sp_gpt2_cpu_layernorm_bwd(float *dinp, float *dw, float *db,
                               const float *dout, const float *inp,
                               const float *w, const float *mean,
                               const float *rstd, int N, int C);
/* Causal self-attention of B sequences of T, NH heads over C = NH * hs:
 * qkv [B*T, 3C] (q, k, v side by side), att [B, NH, T, T] the softmax
 * probabilities (zero where masked), out [B*T, C]; query rows go in tiles
 * of 64, each over the keys up to its last row. allow [T, T] (row t,
 * column t2): nonzero where t may attend t2, ANDed with t2 <= t; NULL: the
 * causal mask alone. A row with nothing allowed is all zero. */
void sp_gpt2_cpu_attention_fwd(float *out, float *att, const float *qkv,
                               const uint8_t *allow, int B, int T, int C,
                               int NH);
/* dqkv [B*T, 3C] overwritten; datt: T*T floats of scratch. */
void sp_gpt2_cpu_attention_bwd(float *dqkv, float *datt, const float *dout,
                               const float *qkv, const float *att, int B, int T,
                               int C, int NH);
/* GELU, tanh approximation (Hugging Face gelu_new). */
void sp_gpt2_cpu_gelu_fwd(float *restrict out, const float *restrict inp,
                          size_t n);
/* dinp = dout * gelu'(inp); dinp may be dout. */
void sp_gpt2_cpu_gelu_bwd(float *dinp, const float *inp, const float *dout,
                          size_t n);
/* probs [N, V] holds logits on entry, the softmax on return; returns
 * sum over rows of -log softmax[tgt] in double (log-sum-exp in double). */
double sp_gpt2_cpu_softmax_xent_fwd(float *probs, const int32_t *tgt, int N,
                                    int V);
/* probs becomes dlogits = (probs - onehot(tgt)) * scale, in place. */
void sp_gpt2_cpu_softmax_xent_bwd(float *probs, const int32_t *tgt, int N,
                                  int V, float scale);
/* The embeddings: x[i] = wte[tok[i]] + wpe[i mod T] (N = B*T rows of C;
 * tokens < V, checked by the caller). */
void sp_gpt2_cpu_embed_fwd(float *x, const int32_t *tok, const float *wte,
                           const float *wpe, int N, int T, int C);
/* dwte [V, C] overwritten: row tok[i] sums dx[i], tokens in index order. */
void sp_gpt2_cpu_wte_bwd(float *dwte, const float *dx, const int32_t *tok,
                         int N, int C, int V);
/* dwte [V, C] float32 += the same sums, through rows (N x C at most) and
 * row_of (V ints): each token's rows of dx summed in index order, then
 * added to its row of dwte once (the float sum of dwte and the sum, as
 * sp_gpt2_cpu_wte_bwd then an exact float32 add would give); rows of
 * tokens not in tok are not touched. */
void sp_gpt2_cpu_wte_bwd_rows(float *dwte, float *rows, int32_t *row_of,
                              const float *dx, const int32_t *tok, int N, int C,
                              int V);
/* dwpe [ctx, C] overwritten: row t sums dx[i] of i mod T == t, in index
 * order; rows from T on are zero. */
void sp_gpt2_cpu_wpe_bwd(float *dwpe, const float *dx, int N, int T, int C,
                         int ctx);
/* y = a + b (the residual; y may be a or b). */
void sp_gpt2_cpu_add(float *y, const float *a, const float *b, size_t n);
/* Rounds every value to dt (bfloat16, float16) in place; other dtypes
 * hold every float32, so nothing changes. */
void sp_gpt2_cpu_round(float *v, size_t n, sp_dtype dt);

#endif
