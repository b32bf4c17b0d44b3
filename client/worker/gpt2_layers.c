/* CPU kernels of the GPT-2 model (gpt2_layers.h). The structure follows
 * llm.c's reference layers; the products go to the BLAS. */
#include "gpt2_layers.h"

#include <cblas.h>
#include <stdbool.h>
#include <math.h>
#include <string.h>

#include "cast/cast_scalar.h"
#include "gpt2_elem.h"

void sp_gpt2k_matmul_fwd(float *out, const float *inp, const float *w,
                         const float *b, int N, int IC, int OC) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, OC, IC, 1.0f, inp,
              IC, w, OC, 0.0f, out, OC);
  if (b == NULL) return;
  for (int i = 0; i < N; i++) {
    float *o = out + (size_t)i * OC;
    for (int j = 0; j < OC; j++) o[j] += b[j];
  }
}

void sp_gpt2k_matmul_bwd(float *dinp, float *dw, float *db, const float *dout,
                         const float *inp, const float *w, int N, int IC,
                         int OC, int acc) {
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, IC, OC, 1.0f,
                dout, OC, w, OC, 0.0f, dinp, IC);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, IC, OC, N, 1.0f, inp,
              IC, dout, OC, acc ? 1.0f : 0.0f, dw, OC);
  if (db == NULL) return;
  if (!acc) memset(db, 0, (size_t)OC * sizeof *db);
  for (int i = 0; i < N; i++) {
    const float *g = dout + (size_t)i * OC;
    for (int j = 0; j < OC; j++) db[j] += g[j];
  }
}

void sp_gpt2k_logits_fwd(float *logits, const float *x, const float *wte,
                         int N, int C, int V) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, C, 1.0f, x, C,
              wte, C, 0.0f, logits, V);
}

void sp_gpt2k_logits_bwd(float *dx, float *dwte, const float *dlogits,
                         const float *x, const float *wte, int N, int C,
                         int V) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, V, 1.0f,
              dlogits, V, wte, C, 0.0f, dx, C);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, N, 1.0f, dlogits,
              V, x, C, 0.0f, dwte, C);
}

void sp_gpt2k_layernorm_fwd(float *out, float *mean, float *rstd,
                            const float *inp, const float *w, const float *b,
                            int N, int C) {
  for (int i = 0; i < N; i++) {
    const float *x = inp + (size_t)i * C;
    float m = 0.0f;
    for (int c = 0; c < C; c++) m += x[c];
    m /= (float)C;
    float v = 0.0f;
    for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
    v /= (float)C;
    float s = sp_gpt2e_ln_rstd(v);
    float *o = out + (size_t)i * C;
    for (int c = 0; c < C; c++) o[c] = sp_gpt2e_ln_out(x[c], m, s, w[c], b[c]);
    mean[i] = m;
    rstd[i] = s;
  }
}

void sp_gpt2k_layernorm_bwd(float *dinp, float *dw, float *db,
                            const float *dout, const float *inp,
                            const float *w, const float *mean,
                            const float *rstd, int N, int C) {
  memset(dw, 0, (size_t)C * sizeof *dw);
  memset(db, 0, (size_t)C * sizeof *db);
  for (int i = 0; i < N; i++) {
    const float *g = dout + (size_t)i * C, *x = inp + (size_t)i * C;
    float *dx = dinp + (size_t)i * C;
    float m = mean[i], s = rstd[i];
    float gm = 0.0f, gnm = 0.0f; /* means of g*w and g*w*xhat */
    for (int c = 0; c < C; c++) {
      float xh = (x[c] - m) * s, gw = g[c] * w[c];
      gm += gw;
      gnm += gw * xh;
    }
    gm /= (float)C;
    gnm /= (float)C;
    for (int c = 0; c < C; c++) {
      float xh = (x[c] - m) * s;
      db[c] += g[c];
      dw[c] += xh * g[c];
      dx[c] += sp_gpt2e_ln_dx(g[c], w[c], x[c], m, s, gm, gnm);
    }
  }
}

void sp_gpt2k_attention_fwd(float *out, float *att, const float *qkv,
                            const uint8_t *allow, int B, int T, int C,
                            int NH) {
  int hs = C / NH, C3 = 3 * C;
  float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *q = qkv + (size_t)b * T * C3 + (size_t)h * hs;
      const float *k = q + C, *v = q + 2 * C;
      float *s = att + ((size_t)b * NH + h) * T * T;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q,
                  C3, k, C3, 0.0f, s, T);
      for (int t = 0; t < T; t++) {
        float *r = s + (size_t)t * T;
        const uint8_t *al = allow ? allow + (size_t)t * T : NULL;
        float mx = -INFINITY;
        for (int u = 0; u <= t; u++)
          if ((!al || al[u]) && r[u] > mx) mx = r[u];
        float sum = 0.0f;
        for (int u = 0; u < T; u++) {
          bool on = u <= t && (!al || al[u]);
          r[u] = on ? expf(r[u] - mx) : 0.0f;
          sum += r[u];
        }
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int u = 0; u <= t; u++) r[u] *= inv;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, s,
                  T, v, C3, 0.0f, out + (size_t)b * T * C + (size_t)h * hs, C);
    }
}

void sp_gpt2k_attention_bwd(float *dqkv, float *datt, const float *dout,
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
      /* datt = dy v^T; dv = att^T dy */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dy,
                  C, v, C3, 0.0f, datt, T);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, s,
                  T, dy, C, 0.0f, dv, C3);
      /* through the softmax: ds = att * (datt - sum(att * datt)) */
      for (int t = 0; t < T; t++) {
        const float *p = s + (size_t)t * T;
        float *g = datt + (size_t)t * T;
        float dot = 0.0f;
        for (int u = 0; u <= t; u++) dot += p[u] * g[u];
        for (int u = 0; u < T; u++)
          g[u] = sp_gpt2e_softmax_bwd(p[u], g[u], dot, u <= t);
      }
      /* dq = scale ds k; dk = scale ds^T q */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale,
                  datt, T, k, C3, 0.0f, dq, C3);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale,
                  datt, T, q, C3, 0.0f, dk, C3);
    }
}

void sp_gpt2k_gelu_fwd(float *restrict out, const float *restrict inp,
                       size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = sp_gpt2e_gelu(inp[i]);
}

void sp_gpt2k_gelu_bwd(float *dinp, const float *inp, const float *dout,
                       size_t n) {
  for (size_t i = 0; i < n; i++) dinp[i] = sp_gpt2e_gelu_bwd(inp[i], dout[i]);
}

double sp_gpt2k_softmax_xent_fwd(float *probs, const int32_t *tgt, int N,
                                 int V) {
  double total = 0.0;
  for (int i = 0; i < N; i++) {
    float *r = probs + (size_t)i * V;
    float mx = r[0];
    for (int j = 1; j < V; j++)
      if (r[j] > mx) mx = r[j];
    double sum = 0.0;
    for (int j = 0; j < V; j++) sum += exp((double)r[j] - (double)mx);
    total += (double)mx + log(sum) - (double)r[tgt[i]];
    for (int j = 0; j < V; j++)
      r[j] = (float)(exp((double)r[j] - (double)mx) / sum);
  }
  return total;
}

void sp_gpt2k_softmax_xent_bwd(float *probs, const int32_t *tgt, int N,
                               int V, float scale) {
  for (int i = 0; i < N; i++) {
    float *r = probs + (size_t)i * V;
    for (int j = 0; j < V; j++) r[j] = sp_gpt2e_xent_bwd(r[j], j == tgt[i], scale);
  }
}

void sp_gpt2k_embed_fwd(float *x, const int32_t *tok, const float *wte,
                        const float *wpe, int N, int T, int C) {
  for (int i = 0; i < N; i++) {
    const float *te = wte + (size_t)tok[i] * C, *pe = wpe + (size_t)(i % T) * C;
    float *o = x + (size_t)i * C;
    for (int c = 0; c < C; c++) o[c] = te[c] + pe[c];
  }
}

void sp_gpt2k_wte_bwd(float *dwte, const float *dx, const int32_t *tok, int N,
                      int C, int V) {
  memset(dwte, 0, (size_t)V * (size_t)C * sizeof *dwte);
  for (int i = 0; i < N; i++) {
    float *r = dwte + (size_t)tok[i] * C;
    const float *g = dx + (size_t)i * C;
    for (int c = 0; c < C; c++) r[c] += g[c];
  }
}

void sp_gpt2k_wpe_bwd(float *dwpe, const float *dx, int N, int T, int C,
                      int ctx) {
  memset(dwpe, 0, (size_t)ctx * (size_t)C * sizeof *dwpe);
  for (int i = 0; i < N; i++) {
    float *r = dwpe + (size_t)(i % T) * C;
    const float *g = dx + (size_t)i * C;
    for (int c = 0; c < C; c++) r[c] += g[c];
  }
}

void sp_gpt2k_add(float *y, const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

void sp_gpt2k_round(float *v, size_t n, sp_dtype dt) {
  if (dt == SP_BFLOAT16)
    for (size_t i = 0; i < n; i++) v[i] = sp_f32_round_bf16(v[i]);
  else if (dt == SP_FLOAT16)
    for (size_t i = 0; i < n; i++) v[i] = sp_f32_round_f16(v[i]);
}
