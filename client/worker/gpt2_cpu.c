/* CPU kernels of the GPT-2 model (gpt2_cpu.h), sp_gpt2_cpu_X, each the
 * reference its GPU twin sp_gpt2_gpu_X (gpt2_gpu.cu) is tested against.
 * The structure follows llm.c's reference layers; the products go to the
 * BLAS. */
#include "gpt2_cpu.h"

#include <cblas.h>
#include <stdbool.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/vec_clones.h"
#include "cast/cast_scalar.h"
#include "gpt2_elem.h"

/* The elementwise loops are cloned per vector width (base/vec_clones.h);
 * the lane sums below fix their order in the source, so every clone gives
 * the same bits. */
#define VEC_CLONES SP_VEC_CLONES

/* Row sums run in LANES interleaved partial sums, added pairwise at the
 * end (LANE_FOLD): a single running sum is one chain of dependent adds,
 * 4 cycles each, which no compiler may vectorize; the lanes' order is
 * fixed, so the sums stay deterministic. With serial sums the softmax
 * rows and LayerNorm were 9 % of a gpt2-mini step. (The maximum folds the
 * same way; its value does not depend on the order.) */
#define LANES 16

#define ADD_OP(a, b) ((a) + (b))
#define MAX_OP(a, b) ((b) > (a) ? (b) : (a))

/* out = OP over k in [0, n) of expr (which reads k), from init, in lanes
 * combined pairwise. */
#define LANE_FOLD(out, n, k, expr, init, OP)                                  \
  do {                                                                        \
    float acc_[LANES];                                                        \
    for (int j_ = 0; j_ < LANES; j_++) acc_[j_] = init;                       \
    int base_ = 0;                                                            \
    for (; base_ + LANES <= (n); base_ += LANES)                              \
      for (int j_ = 0; j_ < LANES; j_++) {                                    \
        int k = base_ + j_;                                                   \
        acc_[j_] = OP(acc_[j_], (expr));                                      \
      }                                                                       \
    for (int j_ = 0; base_ + j_ < (n); j_++) {                                \
      int k = base_ + j_;                                                     \
      acc_[j_] = OP(acc_[j_], (expr));                                        \
    }                                                                         \
    for (int s_ = LANES / 2; s_ > 0; s_ /= 2)                                 \
      for (int j_ = 0; j_ < s_; j_++) acc_[j_] = OP(acc_[j_], acc_[j_ + s_]); \
    (out) = acc_[0];                                                          \
  } while (0)
#define LANE_SUM(out, n, k, expr) LANE_FOLD(out, n, k, expr, 0.0f, ADD_OP)

/* Causal attention runs in tiles of this many query rows: a tile's scores
 * need only the keys up to its last row, so the products skip the masked
 * upper triangle (at T = 256, 10 of 16 tiles' worth of work: 62.5 %). */
#define ATT_TILE 64

/* The bias goes in first and the product is added to it (beta 1), as
 * torch.addmm does: the same single rounding of sum + bias as adding it
 * afterwards, without a second pass over the output. */
static void fill_rows(float *restrict out, const float *restrict b, int N,
                      int OC) {
  for (int i = 0; i < N; i++) memcpy(out + (size_t)i * OC, b, (size_t)OC * 4);
}

void sp_gpt2_cpu_matmul_fwd(float *out, const float *inp, const float *w,
                            const float *b, int N, int IC, int OC) {
  if (b) fill_rows(out, b, N, OC);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, OC, IC, 1.0f, inp,
              IC, w, OC, b ? 1.0f : 0.0f, out, OC);
}

VEC_CLONES
static void col_sums(float *restrict db, const float *restrict dout, int N,
                     int OC) {
  for (int i = 0; i < N; i++) {
    const float *g = dout + (size_t)i * OC;
    for (int j = 0; j < OC; j++) db[j] += g[j];
  }
}

void sp_gpt2_cpu_matmul_bwd(float *dinp, float *dw, float *db,
                            const float *dout, const float *inp, const float *w,
                            int N, int IC, int OC, int acc) {
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, IC, OC, 1.0f, dout,
                OC, w, OC, 0.0f, dinp, IC);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, IC, OC, N, 1.0f, inp, IC,
              dout, OC, acc ? 1.0f : 0.0f, dw, OC);
  if (db == NULL) return;
  if (!acc) memset(db, 0, (size_t)OC * sizeof *db);
  col_sums(db, dout, N, OC);
}

void sp_gpt2_cpu_logits_fwd(float *logits, const float *x, const float *wte,
                            int N, int C, int V) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, C, 1.0f, x, C, wte,
              C, 0.0f, logits, V);
}

void sp_gpt2_cpu_logits_bwd(float *dx, float *dwte, const float *dlogits,
                            const float *x, const float *wte, int N, int C,
                            int V, int acc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, V, 1.0f, dlogits,
              V, wte, C, 0.0f, dx, C);
  if (dwte)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, N, 1.0f, dlogits,
                V, x, C, acc ? 1.0f : 0.0f, dwte, C);
}

VEC_CLONES
static void layernorm_row(float *restrict o, float *mean, float *rstd,
                          const float *restrict x, const float *restrict w,
                          const float *restrict b, int C) {
  float m, v;
  LANE_SUM(m, C, c, x[c]);
  m /= (float)C;
  LANE_SUM(v, C, c, (x[c] - m) * (x[c] - m));
  v /= (float)C;
  float s = sp_gpt2_elem_ln_rstd(v);
  for (int c = 0; c < C; c++)
    o[c] = sp_gpt2_elem_ln_out(x[c], m, s, w[c], b[c]);
  *mean = m;
  *rstd = s;
}

void sp_gpt2_cpu_layernorm_fwd(float *out, float *mean, float *rstd,
                               const float *inp, const float *w, const float *b,
                               int N, int C) {
  for (int i = 0; i < N; i++)
    layernorm_row(out + (size_t)i * C, mean + i, rstd + i, inp + (size_t)i * C,
                  w, b, C);
}

VEC_CLONES
static void layernorm_row_bwd(float *restrict dx, float *restrict dw,
                              float *restrict db, const float *restrict g,
                              const float *restrict x, const float *restrict w,
                              float m, float s, int C) {
  float gm, gnm; /* means of g*w and g*w*xhat */
  LANE_SUM(gm, C, c, g[c] * w[c]);
  LANE_SUM(gnm, C, c, g[c] * w[c] * ((x[c] - m) * s));
  gm /= (float)C;
  gnm /= (float)C;
  for (int c = 0; c < C; c++) {
    float xh = (x[c] - m) * s;
    db[c] += g[c];
    dw[c] += xh * g[c];
    dx[c] += sp_gpt2_elem_ln_dx(g[c], w[c], x[c], m, s, gm, gnm);
  }
}

void sp_gpt2_cpu_layernorm_bwd(float *dinp, float *dw, float *db,
                               const float *dout, const float *inp,
                               const float *w, const float *mean,
                               const float *rstd, int N, int C) {
  memset(dw, 0, (size_t)C * sizeof *dw);
  memset(db, 0, (size_t)C * sizeof *db);
  for (int i = 0; i < N; i++)
    layernorm_row_bwd(dinp + (size_t)i * C, dw, db, dout + (size_t)i * C,
                      inp + (size_t)i * C, w, mean[i], rstd[i], C);
}

VEC_CLONES
void sp_gpt2_cpu_gelu_fwd(float *restrict out, const float *restrict inp,
                          size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = sp_gpt2_elem_gelu(inp[i]);
}

VEC_CLONES
void sp_gpt2_cpu_gelu_bwd(float *dinp, const float *inp, const float *dout,
                          size_t n) {
  for (size_t i = 0; i < n; i++)
    dinp[i] = sp_gpt2_elem_gelu_bwd(inp[i], dout[i]);
}

/* One row of causal softmax in place: r[0..t] (where al allows) become
 * the probabilities, r(t..T) 0. exp is sp_gpt2_elem_exp (about one ulp from
 * expf) so that the row vectorizes: the libm call per score was most of
 * the attention's own time. */
VEC_CLONES
static void softmax_row(float *restrict r, const uint8_t *restrict al, int t,
                        int T) {
  int n = t + 1;
  float m, sum;
  LANE_FOLD(m, n, u, (!al || al[u]) ? r[u] : -INFINITY, -INFINITY, MAX_OP);
  for (int u = 0; u < n; u++)
    r[u] = (!al || al[u]) ? sp_gpt2_elem_exp(r[u] - m) : 0.0f;
  LANE_SUM(sum, n, u, r[u]);
  float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int u = 0; u < n; u++) r[u] *= inv;
  for (int u = n; u < T; u++) r[u] = 0.0f;
}

void sp_gpt2_cpu_attention_fwd(float *out, float *att, const float *qkv,
                               const uint8_t *allow, int B, int T, int C,
                               int NH) {
  int hs = C / NH, C3 = 3 * C;
  float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *q = qkv + (size_t)b * T * C3 + (size_t)h * hs;
      const float *k = q + C, *v = q + 2 * C;
      float *s = att + ((size_t)b * NH + h) * T * T;
      float *y = out + (size_t)b * T * C + (size_t)h * hs;
      /* rows [r0, r1) attend keys [0, r1) at most */
      for (int r0 = 0; r0 < T; r0 += ATT_TILE) {
        int r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs,
                    scale, q + (size_t)r0 * C3, C3, k, C3, 0.0f,
                    s + (size_t)r0 * T, T);
        for (int t = r0; t < r1; t++)
          softmax_row(s + (size_t)t * T, allow ? allow + (size_t)t * T : NULL,
                      t, T);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1,
                    1.0f, s + (size_t)r0 * T, T, v, C3, 0.0f,
                    y + (size_t)r0 * C, C);
      }
    }
}

/* Through the softmax for row t: g = p * (g - sum(p * g)) on [0, t], 0
 * on (t, end), the rest of the query tile. */
VEC_CLONES
static void softmax_row_bwd(float *restrict g, const float *restrict p, int t,
                            int end) {
  float dot;
  LANE_SUM(dot, t + 1, u, p[u] * g[u]);
  for (int u = 0; u <= t; u++)
    g[u] = sp_gpt2_elem_softmax_bwd(p[u], g[u], dot, 1);
  for (int u = t + 1; u < end; u++) g[u] = 0.0f;
}

void sp_gpt2_cpu_attention_bwd(float *dqkv, float *datt, const float *dout,
                               const float *qkv, const float *att, int B, int T,
                               int C, int NH) {
  int hs = C / NH, C3 = 3 * C;
  float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      size_t off = (size_t)b * T * C3 + (size_t)h * hs;
      const float *q = qkv + off, *k = q + C, *v = q + 2 * C;
      float *dq = dqkv + off, *dk = dq + C, *dv = dq + 2 * C;
      const float *s = att + ((size_t)b * NH + h) * T * T;
      const float *dy = dout + (size_t)b * T * C + (size_t)h * hs;
      /* by tiles of rows [r0, r1) (queries) and of columns [r0, r1)
       * (keys): the probabilities are 0 past the diagonal, so a query
       * tile needs keys [0, r1) and a key tile queries [r0, T) */
      for (int r0 = 0; r0 < T; r0 += ATT_TILE) {
        int r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T, m = r1 - r0;
        /* datt = dy v^T */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, r1, hs, 1.0f,
                    dy + (size_t)r0 * C, C, v, C3, 0.0f, datt + (size_t)r0 * T,
                    T);
        /* dv = att^T dy */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, hs, T - r0,
                    1.0f, s + (size_t)r0 * T + r0, T, dy + (size_t)r0 * C, C,
                    0.0f, dv + (size_t)r0 * C3, C3);
        for (int t = r0; t < r1; t++)
          softmax_row_bwd(datt + (size_t)t * T, s + (size_t)t * T, t, r1);
        /* dq = scale ds k */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, hs, r1, scale,
                    datt + (size_t)r0 * T, T, k, C3, 0.0f, dq + (size_t)r0 * C3,
                    C3);
      }
      /* dk = scale ds^T q, once every row of ds is done */
      for (int r0 = 0; r0 < T; r0 += ATT_TILE) {
        int r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1 - r0, hs,
                    T - r0, scale, datt + (size_t)r0 * T + r0, T,
                    q + (size_t)r0 * C3, C3, 0.0f, dk + (size_t)r0 * C3, C3);
      }
    }
}

double sp_gpt2_cpu_softmax_xent_fwd(float *probs, const int32_t *tgt, int N,
                                    int V) {
  /* each exp is computed once and kept for the division (it was computed
   * twice: 6 % of a GPT-2 124M step went to the head's double exps); a
   * row of V doubles, 400 KB for GPT-2, or without it the two passes */
  double *e = malloc((size_t)V * sizeof *e);
  double total = 0.0;
  for (int i = 0; i < N; i++) {
    float *r = probs + (size_t)i * V;
    float mx = r[0];
    for (int j = 1; j < V; j++)
      if (r[j] > mx) mx = r[j];
    double sum = 0.0;
    for (int j = 0; j < V; j++) {
      double x = exp((double)r[j] - (double)mx);
      if (e) e[j] = x;
      sum += x;
    }
    total += (double)mx + log(sum) - (double)r[tgt[i]];
    for (int j = 0; j < V; j++)
      r[j] = (float)((e ? e[j] : exp((double)r[j] - (double)mx)) / sum);
  }
  free(e);
  return total;
}

void sp_gpt2_cpu_softmax_xent_bwd(float *probs, const int32_t *tgt, int N,
                                  int V, float scale) {
  for (int i = 0; i < N; i++) {
    float *r = probs + (size_t)i * V;
    for (int j = 0; j < V; j++)
      r[j] = sp_gpt2_elem_xent_bwd(r[j], j == tgt[i], scale);
  }
}

void sp_gpt2_cpu_embed_fwd(float *x, const int32_t *tok, const float *wte,
                           const float *wpe, int N, int T, int C) {
  for (int i = 0; i < N; i++) {
    const float *te = wte + (size_t)tok[i] * C, *pe = wpe + (size_t)(i % T) * C;
    float *o = x + (size_t)i * C;
    for (int c = 0; c < C; c++) o[c] = te[c] + pe[c];
  }
}

void sp_gpt2_cpu_wte_bwd(float *dwte, const float *dx, const int32_t *tok,
                         int N, int C, int V) {
  memset(dwte, 0, (size_t)V * (size_t)C * sizeof *dwte);
  for (int i = 0; i < N; i++) {
    float *r = dwte + (size_t)tok[i] * C;
    const float *g = dx + (size_t)i * C;
    for (int c = 0; c < C; c++) r[c] += g[c];
  }
}

void sp_gpt2_cpu_wte_bwd_rows(float *dwte, float *rows, int32_t *row_of,
                              const float *dx, const int32_t *tok, int N, int C,
                              int V) {
  for (int v = 0; v < V; v++) row_of[v] = -1;
  int n_rows = 0;
  for (int i = 0; i < N; i++) {
    float *r;
    if (row_of[tok[i]] < 0) {
      row_of[tok[i]] = n_rows;
      r = rows + (size_t)n_rows++ * C;
      memset(r, 0, (size_t)C * sizeof *r);
    } else {
      r = rows + (size_t)row_of[tok[i]] * C;
    }
    const float *g = dx + (size_t)i * C;
    for (int c = 0; c < C; c++) r[c] += g[c];
  }
  for (int i = 0; i < N; i++) {
    if (row_of[tok[i]] < 0) continue; /* added already */
    float *w = dwte + (size_t)tok[i] * C;
    const float *r = rows + (size_t)row_of[tok[i]] * C;
    for (int c = 0; c < C; c++) w[c] += r[c];
    row_of[tok[i]] = -1;
  }
}

void sp_gpt2_cpu_wpe_bwd(float *dwpe, const float *dx, int N, int T, int C,
                         int ctx) {
  memset(dwpe, 0, (size_t)ctx * (size_t)C * sizeof *dwpe);
  for (int i = 0; i < N; i++) {
    float *r = dwpe + (size_t)(i % T) * C;
    const float *g = dx + (size_t)i * C;
    for (int c = 0; c < C; c++) r[c] += g[c];
  }
}

void sp_gpt2_cpu_add(float *y, const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

void sp_gpt2_cpu_round(float *v, size_t n, sp_dtype dt) {
  if (dt == SP_BFLOAT16)
    for (size_t i = 0; i < n; i++) v[i] = sp_f32_round_bf16(v[i]);
  else if (dt == SP_FLOAT16)
    for (size_t i = 0; i < n; i++) v[i] = sp_f32_round_f16(v[i]);
}
