/* The GPT-2 model of shardplane-worker (gpt2.h): initialisation, and on
 * the CPU the step of gpt2_step.c through the runtime's views, over a
 * kernel table of host memory and gpt2_cpu.c's kernels (its spec reader
 * is gpt2_spec.c). */
#include "gpt2.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "gpt2_cpu.h"
#include "gpt2_step.h"
#include "mlp.h"

/* ------------------------------------------------------------------ */
/* initialisation                                                      */
/* ------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t hash_str(const char *s) {
  uint64_t h = 0xCBF29CE484222325ull; /* FNV-1a */
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001B3ull;
  return h;
}

/* A standard normal from (key, element) by Box-Muller over two 53-bit
 * uniforms in (0, 1]. */
static double normal(uint64_t key, uint64_t i) {
  uint64_t a = mix64(key ^ mix64(2 * i)), b = mix64(key ^ mix64(2 * i + 1));
  double u1 = ((double)(a >> 11) + 1.0) * 0x1p-53;
  double u2 = (double)(b >> 11) * 0x1p-53;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* Layers counted from the spec, for the residual projections' scale. */
static int64_t count_layers(const sp_model *m) {
  int64_t n = 0;
  char fqn[64];
  for (;;) {
    snprintf(fqn, sizeof fqn, "transformer.h.%lld", (long long)n);
    if (sp_model_find_module(m, fqn) < 0 || n >= 100000) return n;
    n++;
  }
}

void sp_gpt2_init_param(void *user, const sp_model *m, int32_t param,
                        int64_t start, int64_t n, void *dst) {
  if (m == NULL || dst == NULL || param < 0 || (size_t)param >= m->n_params ||
      start < 0 || n <= 0)
    return;
  if (sp_model_find_param(m, "transformer.wte.weight") < 0) {
    sp_mlp_init_param(user, m, param, start, n, dst);
    return;
  }
  const sp_tensor_spec *t = &m->params[param];
  if (!sp_dtype_is_floating(t->dtype)) {
    memset(dst, 0, (size_t)n * sp_dtype_size(t->dtype));
    return;
  }
  double base = 0.0, std = 0.0;
  if (t->ndim >= 2) {
    std = 0.02;
    if (ends_with(t->fqn, ".c_proj.weight")) {
      int64_t L = count_layers(m);
      std = 0.02 / sqrt(2.0 * (double)(L > 0 ? L : 1));
    }
  } else if (strcmp(t->local_name, "weight") == 0) {
    base = 1.0; /* LayerNorm */
  }
  uint64_t key = hash_str(t->fqn);
  for (int64_t k = 0; k < n; k++) {
    double v = base;
    if (std != 0.0) v += std * normal(key, (uint64_t)(start + k));
    sp_elem_store_f64(dst, t->dtype, (size_t)k, v);
  }
}

void sp_gpt2_init_buffer(void *user, const sp_model *m, int32_t buffer,
                         void *dst) {
  (void)user;
  if (m == NULL || dst == NULL || buffer < 0 || (size_t)buffer >= m->n_buffers)
    return;
  const sp_tensor_spec *t = &m->buffers[buffer];
  size_t es = sp_dtype_size(t->dtype);
  memset(dst, 0, (size_t)t->numel * es);
  if (ends_with(t->fqn, ".attn.masked_bias") &&
      sp_dtype_is_floating(t->dtype)) {
    for (int64_t i = 0; i < t->numel; i++)
      sp_elem_store_f64(dst, t->dtype, (size_t)i, -1e4);
  } else if (ends_with(t->fqn, ".attn.bias") && t->ndim >= 2) {
    int64_t T = t->shape[t->ndim - 1], R = t->shape[t->ndim - 2];
    if (T < 1 || R < 1) return;
    for (int64_t i = 0; i < t->numel; i++) {
      int64_t row = (i / T) % R, col = i % T;
      if (col > row) continue;
      if (sp_dtype_is_floating(t->dtype))
        sp_elem_store_f64(dst, t->dtype, (size_t)i, 1.0);
      else
        ((unsigned char *)dst)[(size_t)i * es] = 1; /* bool, uint8, LE ints */
    }
  }
}

/* ------------------------------------------------------------------ */
/* the CPU's kernel table: host memory, gpt2_cpu.c's kernels           */
/* ------------------------------------------------------------------ */

static int host_alloc(size_t bytes, void **out, sp_diag *d) {
  *out = calloc(1, bytes);
  return *out ? 0 : sp_diag_set(d, SP_ENOMEM, "no memory");
}

static int host_zero(sp_gpt2_dev *k, void *p, size_t bytes, sp_diag *d) {
  (void)k, (void)d;
  memset(p, 0, bytes);
  return 0;
}

static int host_to_f32(sp_gpt2_dev *k, float *dst, const void *src, sp_dtype st,
                       size_t n, const char *fqn, sp_diag *d) {
  (void)k;
  int rc = sp_cast(dst, SP_FLOAT32, src, st, n);
  if (rc != 0)
    return sp_diag_set(d, rc, "%s: cast from %s failed", fqn,
                       sp_dtype_name(st));
  return 0;
}

static int host_grad_add(sp_gpt2_dev *k, void *dst, sp_dtype dt,
                         const float *gr, size_t n, sp_diag *d) {
  (void)k;
  if (!sp_dtype_is_floating(dt))
    return sp_diag_set(d, SP_EINVAL, "gradient dtype %s is not floating",
                       sp_dtype_name(dt));
  if (dt == SP_FLOAT32) {
    /* float32 + float32 rounded once is the double sum rounded once */
    unsigned char *b = dst;
    for (size_t i = 0; i < n; i++) {
      float v;
      memcpy(&v, b + 4 * i, 4);
      v += gr[i];
      memcpy(b + 4 * i, &v, 4);
    }
    return 0;
  }
  for (size_t i = 0; i < n; i++)
    sp_elem_store_f64(dst, dt, i, sp_elem_load_f64(dst, dt, i) + (double)gr[i]);
  return 0;
}

static int host_mask(sp_gpt2_dev *k, uint8_t *allow, const void *buf,
                     sp_dtype dt, int T, int ctx, sp_diag *d) {
  (void)k, (void)d;
  size_t es = sp_dtype_size(dt), n = (size_t)T, stride = (size_t)ctx;
  for (size_t t = 0; t < n; t++)
    for (size_t u = 0; u < n; u++) {
      size_t i = t * stride + u;
      bool on;
      if (sp_dtype_is_floating(dt)) {
        on = sp_elem_load_f64(buf, dt, i) != 0.0;
      } else {
        on = false;
        for (size_t b = 0; b < es; b++)
          on |= ((const unsigned char *)buf)[i * es + b] != 0;
      }
      allow[t * n + u] = on;
    }
  return 0;
}

/* The CPU's kernels cannot fail and need no state: each entry of the
 * table runs its kernel and returns 0. */
#define UNPAREN(...) __VA_ARGS__
#define CPU_KERNEL(name, params, args)                                \
  static int cpu_##name(sp_gpt2_dev *k, UNPAREN params, sp_diag *d) { \
    (void)k, (void)d;                                                 \
    sp_gpt2_cpu_##name args;                                          \
    return 0;                                                         \
  }
CPU_KERNEL(embed_fwd,
           (float *x, const int32_t *tok, const float *wte, const float *wpe,
            int N, int T, int C),
           (x, tok, wte, wpe, N, T, C))
CPU_KERNEL(layernorm_fwd,
           (float *out, float *mean, float *rstd, const float *inp,
            const float *w, const float *b, int N, int C),
           (out, mean, rstd, inp, w, b, N, C))
CPU_KERNEL(matmul_fwd,
           (float *out, const float *inp, const float *w, const float *b, int N,
            int IC, int OC),
           (out, inp, w, b, N, IC, OC))
CPU_KERNEL(attention_fwd,
           (float *out, float *att, const float *qkv, const uint8_t *allow,
            int B, int T, int C, int NH),
           (out, att, qkv, allow, B, T, C, NH))
CPU_KERNEL(gelu_fwd, (float *out, const float *inp, size_t n), (out, inp, n))
CPU_KERNEL(add, (float *y, const float *a, const float *b, size_t n),
           (y, a, b, n))
CPU_KERNEL(round, (float *v, size_t n, sp_dtype dt), (v, n, dt))
CPU_KERNEL(logits_fwd,
           (float *logits, const float *x, const float *wte, int N, int C,
            int V),
           (logits, x, wte, N, C, V))
CPU_KERNEL(softmax_xent_bwd,
           (float *probs, const int32_t *tgt, int N, int V, float scale),
           (probs, tgt, N, V, scale))
CPU_KERNEL(logits_bwd,
           (float *dx, float *dwte, const float *dlogits, const float *x,
            const float *wte, int N, int C, int V, int acc),
           (dx, dwte, dlogits, x, wte, N, C, V, acc))
CPU_KERNEL(layernorm_bwd,
           (float *dinp, float *dw, float *db, const float *dout,
            const float *inp, const float *w, const float *mean,
            const float *rstd, int N, int C),
           (dinp, dw, db, dout, inp, w, mean, rstd, N, C))
CPU_KERNEL(matmul_bwd,
           (float *dinp, float *dw, float *db, const float *dout,
            const float *inp, const float *w, int N, int IC, int OC, int acc),
           (dinp, dw, db, dout, inp, w, N, IC, OC, acc))
CPU_KERNEL(attention_bwd,
           (float *dqkv, float *datt, const float *dout, const float *qkv,
            const float *att, int B, int T, int C, int NH),
           (dqkv, datt, dout, qkv, att, B, T, C, NH))
CPU_KERNEL(gelu_bwd,
           (float *dinp, const float *inp, const float *dout, size_t n),
           (dinp, inp, dout, n))
CPU_KERNEL(wte_bwd,
           (float *dwte, const float *dx, const int32_t *tok, int N, int C,
            int V),
           (dwte, dx, tok, N, C, V))
CPU_KERNEL(wte_bwd_rows,
           (float *dwte, float *rows, int32_t *row_of, const float *dx,
            const int32_t *tok, int N, int C, int V),
           (dwte, rows, row_of, dx, tok, N, C, V))
CPU_KERNEL(wpe_bwd,
           (float *dwpe, const float *dx, int N, int T, int C, int ctx),
           (dwpe, dx, N, T, C, ctx))

/* The loss sums in double on the host: no scratch to keep it in. */
static int cpu_softmax_xent_fwd(sp_gpt2_dev *k, float *probs,
                                const int32_t *tgt, int N, int V, double *rows,
                                double *total, double *sum, sp_diag *d) {
  (void)k, (void)rows, (void)total, (void)d;
  *sum = sp_gpt2_cpu_softmax_xent_fwd(probs, tgt, N, V);
  return 0;
}

static const sp_gpt2_ops cpu_ops = {
    .layout = &sp_gpt2_cpu_layout,
    .alloc = host_alloc,
    .release = free,
    .zero = host_zero,
    .to_f32 = host_to_f32,
    .grad_add = host_grad_add,
    .mask = host_mask,
    .embed_fwd = cpu_embed_fwd,
    .layernorm_fwd = cpu_layernorm_fwd,
    .matmul_fwd = cpu_matmul_fwd,
    .attention_fwd = cpu_attention_fwd,
    .gelu_fwd = cpu_gelu_fwd,
    .add = cpu_add,
    .round = cpu_round,
    .logits_fwd = cpu_logits_fwd,
    .softmax_xent_fwd = cpu_softmax_xent_fwd,
    .softmax_xent_bwd = cpu_softmax_xent_bwd,
    .logits_bwd = cpu_logits_bwd,
    .layernorm_bwd = cpu_layernorm_bwd,
    .matmul_bwd = cpu_matmul_bwd,
    .attention_bwd = cpu_attention_bwd,
    .gelu_bwd = cpu_gelu_bwd,
    .wte_bwd = cpu_wte_bwd,
    .wte_bwd_rows = cpu_wte_bwd_rows,
    .wpe_bwd = cpu_wpe_bwd,
};

/* ------------------------------------------------------------------ */
/* activations and the step's pieces (gpt2_step.c's, on the CPU)       */
/* ------------------------------------------------------------------ */

int sp_gpt2_acts_new_with(const sp_gpt2 *g, size_t B, size_t T,
                          bool checkpointing, bool f32_views,
                          sp_gpt2_acts **out, sp_diag *d) {
  if (g == NULL || out == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2_acts_new: NULL argument");
  *out = NULL;
  sp_gpt2_acts *a = calloc(1, sizeof *a);
  if (a == NULL) return sp_diag_set(d, SP_ENOMEM, "no memory");
  sp_gpt2_shape sh = {B, T, checkpointing, f32_views};
  int rc = sp_gpt2_acts_alloc(&sp_gpt2_cpu_layout, host_alloc, g, &sh, a, d);
  if (rc != 0) {
    sp_gpt2_acts_free(a);
    return rc;
  }
  /* the activations know their layer count through res[L + 1] == NULL */
  *out = a;
  return 0;
}

int sp_gpt2_acts_new(const sp_gpt2 *g, size_t B, size_t T, sp_gpt2_acts **out) {
  return sp_gpt2_acts_new_with(g, B, T, false, false, out, NULL);
}

void sp_gpt2_acts_free(sp_gpt2_acts *a) {
  if (a == NULL) return;
  sp_gpt2_acts_release(free, a);
  free(a);
}

/* The checks every piece starts with, then the step over the CPU's table. */
static int cpu_step(const sp_gpt2 *g, const sp_gpt2_io *io, sp_gpt2_acts *a,
                    sp_gpt2_step *s, sp_diag *d) {
  if (g == NULL || io == NULL || a == NULL || io->param == NULL ||
      io->param_dtype == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: NULL argument or callback");
  if (a->res[g->n_layer] == NULL || a->res[g->n_layer + 1] != NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: activations of another model");
  *s = (sp_gpt2_step){g, &cpu_ops, NULL, a};
  return 0;
}

int sp_gpt2_embed_forward(const sp_gpt2 *g, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, sp_diag *d) {
  sp_gpt2_step s;
  int rc = cpu_step(g, io, a, &s, d);
  size_t N = rc == 0 ? a->B * a->T : 0;
  for (size_t i = 0; rc == 0 && i < N; i++)
    if (a->tok[i] < 0 || a->tok[i] >= g->V)
      rc = sp_diag_set(d, SP_ERANGE, "token %d at %zu: vocabulary of %lld",
                       a->tok[i], i, (long long)g->V);
  return rc ? rc : sp_gpt2_step_embed_forward(&s, io, d);
}

int sp_gpt2_block_forward(const sp_gpt2 *g, size_t l, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, sp_diag *d) {
  sp_gpt2_step s;
  int rc = cpu_step(g, io, a, &s, d);
  return rc ? rc : sp_gpt2_step_block_forward(&s, l, io, d);
}

int sp_gpt2_head_forward(const sp_gpt2 *g, const sp_gpt2_io *io,
                         sp_gpt2_acts *a, double denom, double *loss,
                         sp_diag *d) {
  sp_gpt2_step s;
  int rc = cpu_step(g, io, a, &s, d);
  if (rc == 0) rc = sp_gpt2_step_check_denom(denom, d);
  int N = rc == 0 ? (int)(a->B * a->T) : 0, V = (int)(g ? g->V : 0);
  for (int i = 0; rc == 0 && i < N; i++)
    if (a->tgt[i] < 0 || a->tgt[i] >= V)
      rc = sp_diag_set(d, SP_ERANGE, "target %d at %d: vocabulary of %d",
                       a->tgt[i], i, V);
  return rc ? rc : sp_gpt2_step_head_forward(&s, io, denom, loss, d);
}

void sp_gpt2_last_logprobs(const sp_gpt2 *g, const sp_gpt2_acts *a, size_t b,
                           float *out) {
  if (g == NULL || a == NULL || out == NULL || b >= a->B) return;
  const float *p = a->probs + ((b + 1) * a->T - 1) * (size_t)g->V;
  for (int64_t j = 0; j < g->V; j++)
    out[j] = p[j] > 0.0f ? logf(p[j]) : -INFINITY;
}

int sp_gpt2_head_backward(const sp_gpt2 *g, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, double denom, sp_diag *d) {
  sp_gpt2_step s;
  int rc = cpu_step(g, io, a, &s, d);
  if (rc == 0) rc = sp_gpt2_step_check_denom(denom, d);
  return rc ? rc : sp_gpt2_step_head_backward(&s, io, denom, d);
}

int sp_gpt2_block_backward(const sp_gpt2 *g, size_t l, const sp_gpt2_io *io,
                           sp_gpt2_acts *a, sp_diag *d) {
  sp_gpt2_step s;
  int rc = cpu_step(g, io, a, &s, d);
  return rc ? rc : sp_gpt2_step_block_backward(&s, l, io, d);
}

int sp_gpt2_embed_backward(const sp_gpt2 *g, const sp_gpt2_io *io,
                           sp_gpt2_acts *a, sp_diag *d) {
  sp_gpt2_step s;
  int rc = cpu_step(g, io, a, &s, d);
  return rc ? rc : sp_gpt2_step_embed_backward(&s, io, d);
}
