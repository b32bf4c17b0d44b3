/* The GPT-2 model of shardplane-worker (gpt2.h): spec reader,
 * initialisation, and forward / backward through the runtime's views.
 * The kernels are gpt2_cpu.c's. */
#include "gpt2.h"

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "gpt2_cpu.h"
#include "mlp.h"

/* cblas takes int sizes: every tensor and every activation stays below. */
#define MAX_ELEMS (INT64_C(1) << 31)

/* ------------------------------------------------------------------ */
/* spec reader                                                         */
/* ------------------------------------------------------------------ */

static int unsupported(sp_diag *d, const sp_model *m, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int unsupported(sp_diag *d, const sp_model *m, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return sp_diag_set(d, SP_EUNSUPPORTED, "%s: not a GPT-2: %s",
                     m->path ? m->path : (m->name ? m->name : "model"), buf);
}

/* Param `fqn` with exactly the shape dims[0..nd): its index, or -1 with
 * the error in d. */
static int32_t want(const sp_model *m, const char *fqn, int nd,
                    const int64_t *dims, sp_diag *d) {
  int32_t p = sp_model_find_param(m, fqn);
  if (p < 0) {
    unsupported(d, m, "no parameter %s", fqn);
    return -1;
  }
  const sp_tensor_spec *t = &m->params[p];
  bool ok = t->ndim == nd && sp_dtype_is_floating(t->dtype);
  for (int i = 0; ok && i < nd; i++) ok = t->shape[i] == dims[i];
  if (!ok) {
    char want_s[64] = "", got[64] = "";
    for (int i = 0; i < nd; i++)
      snprintf(want_s + strlen(want_s), sizeof want_s - strlen(want_s),
               "%s%lld", i ? ", " : "", (long long)dims[i]);
    for (int i = 0; i < t->ndim; i++)
      snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld",
               i ? ", " : "", (long long)t->shape[i]);
    unsupported(d, m, "%s: shape [%s] %s, expected [%s] floating", fqn, got,
                sp_dtype_name(t->dtype), want_s);
    return -1;
  }
  return p;
}

static int read_block(const sp_model *m, sp_gpt2 *g, int64_t l,
                      sp_diag *d) {
  sp_gpt2_block *b = &g->blocks[l];
  int64_t C = g->C;
  char fqn[256];
  snprintf(fqn, sizeof fqn, "transformer.h.%lld", (long long)l);
  b->module = sp_model_find_module(m, fqn);
  if (b->module < 0) return unsupported(d, m, "no module %s", fqn);
  static const struct {
    const char *name;
    int nd;
    int64_t r, c; /* multiples of C */
    size_t off;
  } k[] = {
      {"ln_1.weight", 1, 1, 0, offsetof(sp_gpt2_block, ln1_w)},
      {"ln_1.bias", 1, 1, 0, offsetof(sp_gpt2_block, ln1_b)},
      {"attn.c_attn.weight", 2, 1, 3, offsetof(sp_gpt2_block, attn_w)},
      {"attn.c_attn.bias", 1, 3, 0, offsetof(sp_gpt2_block, attn_b)},
      {"attn.c_proj.weight", 2, 1, 1, offsetof(sp_gpt2_block, proj_w)},
      {"attn.c_proj.bias", 1, 1, 0, offsetof(sp_gpt2_block, proj_b)},
      {"ln_2.weight", 1, 1, 0, offsetof(sp_gpt2_block, ln2_w)},
      {"ln_2.bias", 1, 1, 0, offsetof(sp_gpt2_block, ln2_b)},
      {"mlp.c_fc.weight", 2, 1, 4, offsetof(sp_gpt2_block, fc_w)},
      {"mlp.c_fc.bias", 1, 4, 0, offsetof(sp_gpt2_block, fc_b)},
      {"mlp.c_proj.weight", 2, 4, 1, offsetof(sp_gpt2_block, fcproj_w)},
      {"mlp.c_proj.bias", 1, 1, 0, offsetof(sp_gpt2_block, fcproj_b)},
  };
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    char pf[320];
    snprintf(pf, sizeof pf, "%s.%s", fqn, k[i].name);
    int64_t dims[2] = {k[i].r * C, k[i].c * C};
    int32_t p = want(m, pf, k[i].nd, dims, d);
    if (p < 0) return SP_EUNSUPPORTED;
    memcpy((char *)b + k[i].off, &p, sizeof p);
  }
  snprintf(fqn, sizeof fqn, "transformer.h.%lld.attn.bias", (long long)l);
  b->mask = sp_model_find_buffer(m, fqn);
  if (b->mask >= 0) {
    const sp_tensor_spec *t = &m->buffers[b->mask];
    if (t->numel != g->ctx * g->ctx || t->shape[t->ndim - 1] != g->ctx)
      return unsupported(d, m, "%s: %lld elements, expected a [1, 1, %lld, "
                         "%lld] mask", fqn, (long long)t->numel,
                         (long long)g->ctx, (long long)g->ctx);
  }
  return 0;
}

int sp_gpt2_new(const sp_model *m, sp_gpt2 **out, sp_diag *d) {
  if (m == NULL || out == NULL) return SP_EINVAL;
  *out = NULL;
  int32_t wte = sp_model_find_param(m, "transformer.wte.weight");
  int32_t wpe = sp_model_find_param(m, "transformer.wpe.weight");
  if (wte < 0 || wpe < 0)
    return unsupported(d, m, "no parameter %s",
                       wte < 0 ? "transformer.wte.weight"
                               : "transformer.wpe.weight");
  const sp_tensor_spec *te = &m->params[wte], *pe = &m->params[wpe];
  if (te->ndim != 2 || pe->ndim != 2 || te->shape[1] != pe->shape[1])
    return unsupported(d, m, "wte and wpe are not [V, C] and [ctx, C]");
  sp_gpt2 *g = calloc(1, sizeof *g);
  if (g == NULL) return sp_diag_set(d, SP_ENOMEM, "no memory");
  g->model = m;
  g->V = te->shape[0];
  g->C = pe->shape[1];
  g->ctx = pe->shape[0];
  g->wte = wte;
  g->wpe = wpe;
  g->lm_head_module = sp_model_find_module(m, "lm_head");
  int rc = 0;
  /* the sizes the kernels index with int: 4C * C, V * C, ctx * ctx */
  if (g->C < 1 || g->V < 1 || g->ctx < 1 || g->C > 65536 ||
      g->V > MAX_ELEMS / g->C || g->ctx > 65536 ||
      4 * g->C * g->C >= MAX_ELEMS)
    rc = unsupported(d, m, "V %lld, C %lld, ctx %lld out of range",
                     (long long)g->V, (long long)g->C, (long long)g->ctx);
  int64_t heads = 0;
  if (rc == 0 && sp_model_config_int(m, "n_head", &heads) != 0)
    heads = g->C % 64 == 0 ? g->C / 64 : 0;
  if (rc == 0 && (heads < 1 || g->C % heads != 0))
    rc = unsupported(d, m, "config n_head %lld does not divide C = %lld "
                     "(without config.n_head, heads of 64)",
                     (long long)heads, (long long)g->C);
  g->n_head = heads;
  /* blocks: transformer.h.0 .. as long as they exist */
  while (rc == 0 && g->n_layer < 100000) {
    char fqn[64];
    snprintf(fqn, sizeof fqn, "transformer.h.%lld", (long long)g->n_layer);
    if (sp_model_find_module(m, fqn) < 0) break;
    g->n_layer++;
  }
  if (rc == 0 && g->n_layer == 0)
    rc = unsupported(d, m, "no module transformer.h.0");
  if (rc == 0) {
    g->blocks = calloc((size_t)g->n_layer, sizeof *g->blocks);
    if (g->blocks == NULL) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  for (int64_t l = 0; rc == 0 && l < g->n_layer; l++)
    rc = read_block(m, g, l, d);
  int64_t cdim[1] = {g->C};
  if (rc == 0 && (g->lnf_w = want(m, "transformer.ln_f.weight", 1, cdim,
                                  d)) < 0)
    rc = SP_EUNSUPPORTED;
  if (rc == 0 && (g->lnf_b = want(m, "transformer.ln_f.bias", 1, cdim, d)) < 0)
    rc = SP_EUNSUPPORTED;
  int32_t tied = rc == 0 ? sp_model_find_tied(m, "lm_head.weight") : -1;
  if (rc == 0 && (tied < 0 || m->tied[tied].target != wte))
    rc = unsupported(d, m, "lm_head.weight is not tied to "
                     "transformer.wte.weight");
  if (rc != 0) {
    sp_gpt2_free(g);
    return rc;
  }
  *out = g;
  return 0;
}

void sp_gpt2_free(sp_gpt2 *g) {
  if (g == NULL) return;
  free(g->blocks);
  free(g);
}

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
/* activations                                                         */
/* ------------------------------------------------------------------ */

/* n * k floats counted into a->bytes, or NULL with *rc set (SP_ETOOBIG
 * past MAX_ELEMS). */
static float *floats(sp_gpt2_acts *a, int64_t n, int64_t k, int *rc) {
  if (*rc != 0) return NULL;
  if (n < 0 || k < 0 || (k > 0 && n > MAX_ELEMS / k)) {
    *rc = SP_ETOOBIG;
    return NULL;
  }
  size_t count = (size_t)(n * k > 0 ? n * k : 1);
  float *p = calloc(count, sizeof(float));
  if (p == NULL) *rc = SP_ENOMEM;
  else a->bytes += count * sizeof(float);
  return p;
}

static float **per_layer(size_t n, int *rc) {
  if (*rc != 0) return NULL;
  float **p = calloc(n, sizeof *p);
  if (p == NULL) *rc = SP_ENOMEM;
  return p;
}

int sp_gpt2_acts_new(const sp_gpt2 *g, size_t B, size_t T,
                     sp_gpt2_acts **out) {
  if (g == NULL || out == NULL || B == 0 || T == 0 || T > (size_t)g->ctx)
    return SP_EINVAL;
  *out = NULL;
  if (B > (size_t)(MAX_ELEMS / (int64_t)T)) return SP_ETOOBIG;
  sp_gpt2_acts *a = calloc(1, sizeof *a);
  if (a == NULL) return SP_ENOMEM;
  a->B = B;
  a->T = T;
  int64_t N = (int64_t)(B * T), C = g->C, L = g->n_layer;
  int64_t NHTT = (int64_t)B * g->n_head; /* times T * T below */
  int rc = 0;
  if (NHTT > MAX_ELEMS / (int64_t)T / (int64_t)T) rc = SP_ETOOBIG;
  float ***lists[] = {&a->res,  &a->ln1,      &a->ln1_mean, &a->ln1_rstd,
                      &a->qkv,  &a->att,      &a->atty,     &a->res2,
                      &a->ln2,  &a->ln2_mean, &a->ln2_rstd, &a->fch,
                      &a->fch_gelu};
  for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++)
    *lists[i] = per_layer((size_t)L + 2, &rc); /* NULL-terminated */
  for (int64_t l = 0; l < L && rc == 0; l++) {
    a->res[l] = floats(a, N, C, &rc);
    a->ln1[l] = floats(a, N, C, &rc);
    a->ln1_mean[l] = floats(a, N, 1, &rc);
    a->ln1_rstd[l] = floats(a, N, 1, &rc);
    a->qkv[l] = floats(a, N, 3 * C, &rc);
    a->att[l] = floats(a, NHTT * (int64_t)T, (int64_t)T, &rc);
    a->atty[l] = floats(a, N, C, &rc);
    a->res2[l] = floats(a, N, C, &rc);
    a->ln2[l] = floats(a, N, C, &rc);
    a->ln2_mean[l] = floats(a, N, 1, &rc);
    a->ln2_rstd[l] = floats(a, N, 1, &rc);
    a->fch[l] = floats(a, N, 4 * C, &rc);
    a->fch_gelu[l] = floats(a, N, 4 * C, &rc);
  }
  if (rc == 0) a->res[L] = floats(a, N, C, &rc);
  a->lnf = floats(a, N, C, &rc);
  a->lnf_mean = floats(a, N, 1, &rc);
  a->lnf_rstd = floats(a, N, 1, &rc);
  a->probs = floats(a, N, g->V, &rc);
  a->dres = floats(a, N, C, &rc);
  a->dbuf = floats(a, N, C, &rc);
  a->dbig = floats(a, N, 4 * C, &rc);
  a->dqkv = floats(a, N, 3 * C, &rc);
  a->datt = floats(a, (int64_t)T, (int64_t)T, &rc);
  /* the largest param: wte [V, C], wpe [ctx, C] or a [4C, C] matrix */
  int64_t wmax = g->V * C;
  if (g->ctx * C > wmax) wmax = g->ctx * C;
  if (4 * C * C > wmax) wmax = 4 * C * C;
  a->w = floats(a, wmax, 1, &rc);
  a->gw = floats(a, wmax, 1, &rc);
  a->lnw = floats(a, C, 1, &rc);
  a->lnb = floats(a, C, 1, &rc);
  a->gb = floats(a, 4 * C, 1, &rc);
  a->gb2 = floats(a, 4 * C, 1, &rc);
  if (rc == 0) {
    a->tok = calloc((size_t)N, sizeof *a->tok);
    a->tgt = calloc((size_t)N, sizeof *a->tgt);
    a->allow = calloc(T * T, 1);
    if (!a->tok || !a->tgt || !a->allow) rc = SP_ENOMEM;
    a->bytes += 2 * (uint64_t)N * sizeof *a->tok + T * T;
  }
  if (rc != 0) {
    sp_gpt2_acts_free(a);
    return rc;
  }
  /* the activations know their layer count through res[L + 1] == NULL */
  *out = a;
  return 0;
}

void sp_gpt2_acts_free(sp_gpt2_acts *a) {
  if (a == NULL) return;
  float **lists[] = {a->res, a->ln1,  a->ln1_mean, a->ln1_rstd, a->qkv,
                     a->att, a->atty, a->res2,     a->ln2,      a->ln2_mean,
                     a->ln2_rstd, a->fch, a->fch_gelu};
  for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
    for (size_t l = 0; lists[i] && lists[i][l]; l++) free(lists[i][l]);
    free(lists[i]);
  }
  float *single[] = {a->lnf, a->lnf_mean, a->lnf_rstd, a->probs, a->dres,
                     a->dbuf, a->dbig, a->dqkv, a->datt, a->w, a->gw,
                     a->lnw, a->lnb, a->gb, a->gb2};
  for (size_t i = 0; i < sizeof single / sizeof single[0]; i++)
    free(single[i]);
  free(a->tok);
  free(a->tgt);
  free(a->allow);
  free(a);
}

/* ------------------------------------------------------------------ */
/* views                                                               */
/* ------------------------------------------------------------------ */

static const char *fqn_of(const sp_gpt2 *g, int32_t p) {
  return g->model->params[p].fqn;
}

/* A param's view as float32 into dst (numel floats), and its dtype. */
static int load(const sp_gpt2 *g, const sp_gpt2_io *io, int32_t p, float *dst,
                sp_dtype *dt, sp_diag *d) {
  const sp_tensor_spec *t = &g->model->params[p];
  sp_dtype pd = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(pd))
    return sp_diag_set(d, SP_EINVAL, "%s: param dtype %s is not floating",
                       t->fqn, sp_dtype_name(pd));
  const void *v = io->param(io->user, p);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no parameter view (unit sharded?)",
                       t->fqn);
  int rc = sp_cast(dst, SP_FLOAT32, v, pd, (size_t)t->numel);
  if (rc != 0)
    return sp_diag_set(d, rc, "%s: cast from %s failed", t->fqn,
                       sp_dtype_name(pd));
  if (dt) *dt = pd;
  return 0;
}

/* A float32 parameter's view itself when it is aligned for floats (the
 * runtime's flat parameters are), else a float32 copy in scratch: the
 * products read the weights in place, a copy per product cost a pass over
 * every weight twice a step. */
static int view_f32(const sp_gpt2 *g, const sp_gpt2_io *io, int32_t p,
                    float *scratch, const float **out, sp_diag *d) {
  void *v = io->param(io->user, p);
  if (v && io->param_dtype(io->user, p) == SP_FLOAT32 &&
      (uintptr_t)v % _Alignof(float) == 0) {
    *out = v;
    return 0;
  }
  *out = scratch;
  return load(g, io, p, scratch, NULL, d);
}

/* The gradient view as float32 to add to in place (aligned, float32), or
 * NULL: then the gradient goes through a scratch and add_grad. */
static float *grad_f32(const sp_gpt2_io *io, int32_t p) {
  void *v = io->grad ? io->grad(io->user, p) : NULL;
  return v && io->param_dtype(io->user, p) == SP_FLOAT32 &&
                 (uintptr_t)v % _Alignof(float) == 0
             ? v
             : NULL;
}

/* grad view += g, the sum in double rounded once to the view's dtype (as
 * autograd accumulates into .grad). */
static int add_grad(const sp_gpt2 *g, const sp_gpt2_io *io, int32_t p,
                    const float *gr, sp_diag *d) {
  void *dst = io->grad ? io->grad(io->user, p) : NULL;
  if (dst == NULL) return 0;
  sp_dtype pd = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(pd))
    return sp_diag_set(d, SP_EINVAL, "%s: gradient dtype %s is not floating",
                       fqn_of(g, p), sp_dtype_name(pd));
  size_t n = (size_t)g->model->params[p].numel;
  if (pd == SP_FLOAT32) {
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
    sp_elem_store_f64(dst, pd, i, sp_elem_load_f64(dst, pd, i) + (double)gr[i]);
  return 0;
}

static int check(const sp_gpt2 *g, const sp_gpt2_io *io,
                 const sp_gpt2_acts *a, sp_diag *d) {
  if (g == NULL || io == NULL || a == NULL || io->param == NULL ||
      io->param_dtype == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: NULL argument or callback");
  if (a->res[g->n_layer] == NULL || a->res[g->n_layer + 1] != NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: activations of another model");
  return 0;
}

/* The block's mask from its attn.bias buffer (its last T x T corner's top
 * left, as HF slices bias[:, :, :T, :T]); false when it has none. */
static int block_mask(const sp_gpt2 *g, const sp_gpt2_block *b,
                      const sp_gpt2_io *io, sp_gpt2_acts *a, bool *have,
                      sp_diag *d) {
  *have = false;
  if (b->mask < 0 || io->buffer == NULL) return 0;
  const void *v = io->buffer(io->user, b->mask);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no buffer storage",
                       g->model->buffers[b->mask].fqn);
  sp_dtype dt = io->buffer_dtype ? io->buffer_dtype(io->user, b->mask)
                                 : g->model->buffers[b->mask].dtype;
  size_t es = sp_dtype_size(dt), T = a->T, ctx = (size_t)g->ctx;
  for (size_t t = 0; t < T; t++)
    for (size_t u = 0; u < T; u++) {
      size_t i = t * ctx + u;
      bool on;
      if (sp_dtype_is_floating(dt)) {
        on = sp_elem_load_f64(v, dt, i) != 0.0;
      } else {
        on = false;
        for (size_t k = 0; k < es; k++)
          on |= ((const unsigned char *)v)[i * es + k] != 0;
      }
      a->allow[t * T + u] = on;
    }
  *have = true;
  return 0;
}

/* ------------------------------------------------------------------ */
/* forward                                                             */
/* ------------------------------------------------------------------ */

int sp_gpt2_embed_forward(const sp_gpt2 *g, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, sp_diag *d) {
  int rc = check(g, io, a, d);
  size_t C = (size_t)g->C, T = a->T, N = a->B * a->T;
  for (size_t i = 0; rc == 0 && i < N; i++)
    if (a->tok[i] < 0 || a->tok[i] >= g->V)
      rc = sp_diag_set(d, SP_ERANGE, "token %d at %zu: vocabulary of %lld",
                       a->tok[i], i, (long long)g->V);
  sp_dtype pd = SP_FLOAT32;
  float *wpe = a->gw; /* the forward does not need the gradient scratch */
  if (rc == 0) rc = load(g, io, g->wte, a->w, &pd, d);
  if (rc == 0) rc = load(g, io, g->wpe, wpe, NULL, d);
  if (rc != 0) return rc;
  float *x = a->res[0];
  sp_gpt2_cpu_embed_fwd(x, a->tok, a->w, wpe, (int)N, (int)T, (int)C);
  sp_gpt2_cpu_round(x, N * C, pd);
  return 0;
}

int sp_gpt2_block_forward(const sp_gpt2 *g, size_t l, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, sp_diag *d) {
  int rc = check(g, io, a, d);
  if (rc == 0 && l >= (size_t)g->n_layer)
    rc = sp_diag_set(d, SP_ERANGE, "sp_gpt2: block %zu of %lld", l,
                     (long long)g->n_layer);
  if (rc != 0) return rc;
  const sp_gpt2_block *b = &g->blocks[l];
  int N = (int)(a->B * a->T), C = (int)g->C, NH = (int)g->n_head;
  size_t NC = (size_t)N * (size_t)C;
  sp_dtype pd = SP_FLOAT32;
  bool have_mask = false;
  rc = block_mask(g, b, io, a, &have_mask, d);
  if (rc != 0) return rc;
  float *x = a->res[l], *tmp = a->dbuf;
  /* the unit's input cast (FSDP casts a unit's inputs to param_dtype) */
  rc = load(g, io, b->ln1_w, a->lnw, &pd, d);
  if (rc == 0) rc = load(g, io, b->ln1_b, a->lnb, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(x, NC, pd);
  sp_gpt2_cpu_layernorm_fwd(a->ln1[l], a->ln1_mean[l], a->ln1_rstd[l], x,
                            a->lnw, a->lnb, N, C);
  sp_gpt2_cpu_round(a->ln1[l], NC, pd);
  /* attention */
  const float *w;
  rc = view_f32(g, io, b->attn_w, a->w, &w, d);
  if (rc == 0) rc = load(g, io, b->attn_b, a->gb, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_matmul_fwd(a->qkv[l], a->ln1[l], w, a->gb, N, C, 3 * C);
  sp_gpt2_cpu_round(a->qkv[l], 3 * NC, pd);
  sp_gpt2_cpu_attention_fwd(a->atty[l], a->att[l], a->qkv[l],
                            have_mask ? a->allow : NULL, (int)a->B, (int)a->T,
                            C, NH);
  sp_gpt2_cpu_round(a->atty[l], NC, pd);
  rc = view_f32(g, io, b->proj_w, a->w, &w, d);
  if (rc == 0) rc = load(g, io, b->proj_b, a->gb, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_matmul_fwd(tmp, a->atty[l], w, a->gb, N, C, C);
  sp_gpt2_cpu_round(tmp, NC, pd);
  sp_gpt2_cpu_add(a->res2[l], x, tmp, NC);
  sp_gpt2_cpu_round(a->res2[l], NC, pd);
  /* MLP */
  rc = load(g, io, b->ln2_w, a->lnw, NULL, d);
  if (rc == 0) rc = load(g, io, b->ln2_b, a->lnb, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_layernorm_fwd(a->ln2[l], a->ln2_mean[l], a->ln2_rstd[l],
                            a->res2[l], a->lnw, a->lnb, N, C);
  sp_gpt2_cpu_round(a->ln2[l], NC, pd);
  rc = view_f32(g, io, b->fc_w, a->w, &w, d);
  if (rc == 0) rc = load(g, io, b->fc_b, a->gb, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_matmul_fwd(a->fch[l], a->ln2[l], w, a->gb, N, C, 4 * C);
  sp_gpt2_cpu_round(a->fch[l], 4 * NC, pd);
  sp_gpt2_cpu_gelu_fwd(a->fch_gelu[l], a->fch[l], 4 * NC);
  sp_gpt2_cpu_round(a->fch_gelu[l], 4 * NC, pd);
  rc = view_f32(g, io, b->fcproj_w, a->w, &w, d);
  if (rc == 0) rc = load(g, io, b->fcproj_b, a->gb, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_matmul_fwd(tmp, a->fch_gelu[l], w, a->gb, N, 4 * C, C);
  sp_gpt2_cpu_round(tmp, NC, pd);
  float *y = a->res[l + 1];
  sp_gpt2_cpu_add(y, a->res2[l], tmp, NC);
  sp_gpt2_cpu_round(y, NC, pd);
  return 0;
}

int sp_gpt2_head_forward(const sp_gpt2 *g, const sp_gpt2_io *io,
                         sp_gpt2_acts *a, double denom, double *loss,
                         sp_diag *d) {
  int rc = check(g, io, a, d);
  if (rc == 0 && !(denom >= 1.0))
    rc = sp_diag_set(d, SP_EINVAL, "sp_gpt2: loss denominator %g", denom);
  int N = (int)(a->B * a->T), C = (int)g->C, V = (int)g->V;
  for (int i = 0; rc == 0 && i < N; i++)
    if (a->tgt[i] < 0 || a->tgt[i] >= V)
      rc = sp_diag_set(d, SP_ERANGE, "target %d at %d: vocabulary of %d",
                       a->tgt[i], i, V);
  sp_dtype pd = SP_FLOAT32;
  if (rc == 0) rc = load(g, io, g->lnf_w, a->lnw, &pd, d);
  if (rc == 0) rc = load(g, io, g->lnf_b, a->lnb, NULL, d);
  if (rc == 0) rc = load(g, io, g->wte, a->w, NULL, d);
  if (rc != 0) return rc;
  float *x = a->res[g->n_layer];
  size_t NC = (size_t)N * (size_t)C;
  sp_gpt2_cpu_round(x, NC, pd);
  sp_gpt2_cpu_layernorm_fwd(a->lnf, a->lnf_mean, a->lnf_rstd, x, a->lnw, a->lnb,
                            N, C);
  sp_gpt2_cpu_round(a->lnf, NC, pd);
  sp_gpt2_cpu_logits_fwd(a->probs, a->lnf, a->w, N, C, V);
  sp_gpt2_cpu_round(a->probs, (size_t)N * (size_t)V, pd);
  double sum = sp_gpt2_cpu_softmax_xent_fwd(a->probs, a->tgt, N, V);
  if (loss) *loss = sum / denom;
  return 0;
}

void sp_gpt2_last_logprobs(const sp_gpt2 *g, const sp_gpt2_acts *a, size_t b,
                           float *out) {
  if (g == NULL || a == NULL || out == NULL || b >= a->B) return;
  const float *p = a->probs + ((b + 1) * a->T - 1) * (size_t)g->V;
  for (int64_t j = 0; j < g->V; j++)
    out[j] = p[j] > 0.0f ? logf(p[j]) : -INFINITY;
}

/* ------------------------------------------------------------------ */
/* backward                                                            */
/* ------------------------------------------------------------------ */

int sp_gpt2_head_backward(const sp_gpt2 *g, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, double denom, sp_diag *d) {
  int rc = check(g, io, a, d);
  if (rc == 0 && !(denom >= 1.0))
    rc = sp_diag_set(d, SP_EINVAL, "sp_gpt2: loss denominator %g", denom);
  int N = (int)(a->B * a->T), C = (int)g->C, V = (int)g->V;
  sp_dtype pd = SP_FLOAT32;
  if (rc == 0) rc = load(g, io, g->wte, a->w, &pd, d);
  if (rc == 0) rc = load(g, io, g->lnf_w, a->lnw, NULL, d);
  if (rc != 0) return rc;
  size_t NC = (size_t)N * (size_t)C;
  sp_gpt2_cpu_softmax_xent_bwd(a->probs, a->tgt, N, V, (float)(1.0 / denom));
  sp_gpt2_cpu_round(a->probs, (size_t)N * (size_t)V, pd);
  /* dlnf = dlogits wte; dwte = dlogits^T lnf */
  sp_gpt2_cpu_logits_bwd(a->dbuf, a->gw, a->probs, a->lnf, a->w, N, C, V);
  sp_gpt2_cpu_round(a->dbuf, NC, pd);
  rc = add_grad(g, io, g->wte, a->gw, d);
  if (rc != 0) return rc;
  memset(a->dres, 0, NC * sizeof *a->dres);
  sp_gpt2_cpu_layernorm_bwd(a->dres, a->gb, a->gb2, a->dbuf, a->res[g->n_layer],
                            a->lnw, a->lnf_mean, a->lnf_rstd, N, C);
  sp_gpt2_cpu_round(a->dres, NC, pd);
  rc = add_grad(g, io, g->lnf_w, a->gb, d);
  if (rc == 0) rc = add_grad(g, io, g->lnf_b, a->gb2, d);
  return rc;
}

/* A Conv1D's backward: dinp (may be NULL) = dout W^T, and W's and b's
 * gradients added to their views. */
static int conv_bwd(const sp_gpt2 *g, const sp_gpt2_io *io, sp_gpt2_acts *a,
                    int32_t w, int32_t b, float *dinp, const float *dout,
                    const float *inp, int N, int IC, int OC, sp_diag *d) {
  const float *wv;
  int rc = view_f32(g, io, w, a->w, &wv, d);
  if (rc != 0) return rc;
  /* float32 views take the products' sums in place (the BLAS adds to
   * them); others through the scratch, rounded once by add_grad */
  float *gw = grad_f32(io, w), *gbv = grad_f32(io, b);
  if (gw && gbv) {
    sp_gpt2_cpu_matmul_bwd(dinp, gw, gbv, dout, inp, wv, N, IC, OC, 1);
    return 0;
  }
  sp_gpt2_cpu_matmul_bwd(dinp, a->gw, a->gb, dout, inp, wv, N, IC, OC, 0);
  rc = add_grad(g, io, w, a->gw, d);
  if (rc == 0) rc = add_grad(g, io, b, a->gb, d);
  return rc;
}

static int ln_bwd(const sp_gpt2 *g, const sp_gpt2_io *io, sp_gpt2_acts *a,
                  int32_t w, int32_t b, float *dinp, const float *dout,
                  const float *inp, const float *mean, const float *rstd,
                  int N, int C, sp_diag *d) {
  int rc = load(g, io, w, a->lnw, NULL, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_layernorm_bwd(dinp, a->gb, a->gb2, dout, inp, a->lnw, mean, rstd,
                            N, C);
  rc = add_grad(g, io, w, a->gb, d);
  if (rc == 0) rc = add_grad(g, io, b, a->gb2, d);
  return rc;
}

int sp_gpt2_block_backward(const sp_gpt2 *g, size_t l, const sp_gpt2_io *io,
                           sp_gpt2_acts *a, sp_diag *d) {
  int rc = check(g, io, a, d);
  if (rc == 0 && l >= (size_t)g->n_layer)
    rc = sp_diag_set(d, SP_ERANGE, "sp_gpt2: block %zu of %lld", l,
                     (long long)g->n_layer);
  if (rc != 0) return rc;
  const sp_gpt2_block *b = &g->blocks[l];
  int N = (int)(a->B * a->T), C = (int)g->C, NH = (int)g->n_head;
  size_t NC = (size_t)N * (size_t)C;
  sp_dtype pd = io->param_dtype(io->user, b->attn_w);
  /* a->dres: the gradient of the block's output, which the residual
   * passes on unchanged; each branch adds its input gradient to it */
  rc = conv_bwd(g, io, a, b->fcproj_w, b->fcproj_b, a->dbig, a->dres,
                a->fch_gelu[l], N, 4 * C, C, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(a->dbig, 4 * NC, pd);
  sp_gpt2_cpu_gelu_bwd(a->dbig, a->fch[l], a->dbig, 4 * NC);
  sp_gpt2_cpu_round(a->dbig, 4 * NC, pd);
  rc = conv_bwd(g, io, a, b->fc_w, b->fc_b, a->dbuf, a->dbig, a->ln2[l], N, C,
                4 * C, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(a->dbuf, NC, pd);
  rc = ln_bwd(g, io, a, b->ln2_w, b->ln2_b, a->dres, a->dbuf, a->res2[l],
              a->ln2_mean[l], a->ln2_rstd[l], N, C, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(a->dres, NC, pd);
  /* attention branch */
  rc = conv_bwd(g, io, a, b->proj_w, b->proj_b, a->dbuf, a->dres, a->atty[l],
                N, C, C, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(a->dbuf, NC, pd);
  sp_gpt2_cpu_attention_bwd(a->dqkv, a->datt, a->dbuf, a->qkv[l], a->att[l],
                            (int)a->B, (int)a->T, C, NH);
  sp_gpt2_cpu_round(a->dqkv, 3 * NC, pd);
  rc = conv_bwd(g, io, a, b->attn_w, b->attn_b, a->dbuf, a->dqkv, a->ln1[l],
                N, C, 3 * C, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(a->dbuf, NC, pd);
  rc = ln_bwd(g, io, a, b->ln1_w, b->ln1_b, a->dres, a->dbuf, a->res[l],
              a->ln1_mean[l], a->ln1_rstd[l], N, C, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_round(a->dres, NC, pd);
  return 0;
}

int sp_gpt2_embed_backward(const sp_gpt2 *g, const sp_gpt2_io *io,
                           sp_gpt2_acts *a, sp_diag *d) {
  int rc = check(g, io, a, d);
  if (rc != 0) return rc;
  size_t C = (size_t)g->C, T = a->T, N = a->B * a->T;
  /* wte: rows by token, tokens in order */
  sp_gpt2_cpu_wte_bwd(a->gw, a->dres, a->tok, (int)N, (int)C, (int)g->V);
  rc = add_grad(g, io, g->wte, a->gw, d);
  if (rc != 0) return rc;
  sp_gpt2_cpu_wpe_bwd(a->gw, a->dres, (int)N, (int)T, (int)C, (int)g->ctx);
  return add_grad(g, io, g->wpe, a->gw, d);
}
