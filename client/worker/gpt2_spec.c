/* The GPT-2 model's spec reader (gpt2.h, sp_gpt2_new): which specs are a
 * GPT-2 of the supported layout, and where each block's tensors are. It
 * computes nothing, so the `shardplane run` command can ask it before it
 * starts a worker without linking the model's kernels. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt2.h"

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

static int read_block(const sp_model *m, sp_gpt2 *g, int64_t l, sp_diag *d) {
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
      return unsupported(d, m,
                         "%s: %lld elements, expected a [1, 1, %lld, "
                         "%lld] mask",
                         fqn, (long long)t->numel, (long long)g->ctx,
                         (long long)g->ctx);
  }
  return 0;
}

int sp_gpt2_new(const sp_model *m, sp_gpt2 **out, sp_diag *d) {
  if (m == NULL || out == NULL) return SP_EINVAL;
  *out = NULL;
  int32_t wte = sp_model_find_param(m, "transformer.wte.weight");
  int32_t wpe = sp_model_find_param(m, "transformer.wpe.weight");
  if (wte < 0 || wpe < 0)
    return unsupported(
        d, m, "no parameter %s",
        wte < 0 ? "transformer.wte.weight" : "transformer.wpe.weight");
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
      g->V > SP_GPT2_MAX_ELEMS / g->C || g->ctx > 65536 ||
      4 * g->C * g->C >= SP_GPT2_MAX_ELEMS)
    rc = unsupported(d, m, "V %lld, C %lld, ctx %lld out of range",
                     (long long)g->V, (long long)g->C, (long long)g->ctx);
  int64_t heads = 0;
  if (rc == 0 && sp_model_config_int(m, "n_head", &heads) != 0)
    heads = g->C % 64 == 0 ? g->C / 64 : 0;
  if (rc == 0 && (heads < 1 || g->C % heads != 0))
    rc = unsupported(d, m,
                     "config n_head %lld does not divide C = %lld "
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
  if (rc == 0 &&
      (g->lnf_w = want(m, "transformer.ln_f.weight", 1, cdim, d)) < 0)
    rc = SP_EUNSUPPORTED;
  if (rc == 0 && (g->lnf_b = want(m, "transformer.ln_f.bias", 1, cdim, d)) < 0)
    rc = SP_EUNSUPPORTED;
  int32_t tied = rc == 0 ? sp_model_find_tied(m, "lm_head.weight") : -1;
  if (rc == 0 && (tied < 0 || m->tied[tied].target != wte))
    rc = unsupported(d, m,
                     "lm_head.weight is not tied to "
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
