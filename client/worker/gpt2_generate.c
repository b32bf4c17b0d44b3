/* Text from a GPT-2 checkpoint (gpt2_generate.h). */
#include "gpt2_generate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "plan/model.h"
#include "gpt2.h"
#include "safetensors/safetensors.h"

typedef struct held {
  const sp_model *m;
  float **p;
  void **b;
  sp_dtype *bdt;
} held;

static void *h_param(void *u, int32_t i) { return ((held *)u)->p[i]; }
static sp_dtype h_dtype(void *u, int32_t i) {
  (void)u;
  (void)i;
  return SP_FLOAT32;
}
static void *h_buffer(void *u, int32_t i) { return ((held *)u)->b[i]; }
static sp_dtype h_bdtype(void *u, int32_t i) { return ((held *)u)->bdt[i]; }

/* Tensor `fqn` of the checkpoint, of the spec's shape, into dst as dt. */
static int take(const sp_safetensors_file *f, const char *file,
                const sp_tensor_spec *t, sp_dtype dt, void *dst, sp_diag *d) {
  const sp_safetensors_tensor *st = sp_safetensors_find(f, t->fqn);
  if (st == NULL)
    return sp_diag_set(d, SP_ENOENT, "%s: no tensor %s", file, t->fqn);
  if (st->numel != (uint64_t)t->numel)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s: %s has %llu elements, the spec "
                       "%lld",
                       file, t->fqn, (unsigned long long)st->numel,
                       (long long)t->numel);
  if (st->dtype == dt) {
    memcpy(dst, st->data, st->nbytes);
    return 0;
  }
  int rc = sp_cast(dst, dt, st->data, st->dtype, (size_t)t->numel);
  return rc ? sp_diag_set(d, rc, "%s: %s: cannot convert %s to %s", file,
                          t->fqn, sp_dtype_name(st->dtype), sp_dtype_name(dt))
            : 0;
}

static int load_all(held *h, const char *file, sp_diag *d) {
  const sp_model *m = h->m;
  sp_safetensors_file *f = NULL;
  int rc = sp_safetensors_open(file, &f, d);
  if (rc != 0) return rc;
  h->p = calloc(m->n_params, sizeof *h->p);
  h->b = calloc(m->n_buffers + 1, sizeof *h->b);
  h->bdt = calloc(m->n_buffers + 1, sizeof *h->bdt);
  if (!h->p || !h->b || !h->bdt) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t i = 0; rc == 0 && i < m->n_params; i++) {
    h->p[i] = malloc((size_t)m->params[i].numel * sizeof(float));
    rc = h->p[i] ? take(f, file, &m->params[i], SP_FLOAT32, h->p[i], d)
                 : sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  for (size_t i = 0; rc == 0 && i < m->n_buffers; i++) {
    const sp_tensor_spec *t = &m->buffers[i];
    h->bdt[i] = t->dtype;
    h->b[i] = calloc((size_t)t->numel + 1, sp_dtype_size(t->dtype));
    if (h->b[i] == NULL) {
      rc = sp_diag_set(d, SP_ENOMEM, "no memory");
      break;
    }
    /* a non-persistent buffer is in no checkpoint: its initial value */
    if (!t->flag || sp_safetensors_find(f, t->fqn) == NULL)
      sp_gpt2_init_buffer(NULL, m, (int32_t)i, h->b[i]);
    else
      rc = take(f, file, t, t->dtype, h->b[i], d);
  }
  sp_safetensors_close(f);
  return rc;
}

static void held_free(held *h) {
  for (size_t i = 0; h->p && i < h->m->n_params; i++) free(h->p[i]);
  for (size_t i = 0; h->b && i < h->m->n_buffers; i++) free(h->b[i]);
  free(h->p);
  free(h->b);
  free(h->bdt);
}

static uint64_t next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void put(FILE *out, int c) {
  fputc(c == '\n' || c == '\t' || (c >= 32 && c < 127) ? c : '?', out);
}

int sp_gpt2_generate(const sp_gpt2_gen_opts *o, FILE *out, sp_diag *d) {
  if (o == NULL || out == NULL || !(o->temperature >= 0) ||
      !isfinite(o->temperature))
    return sp_diag_set(d, SP_EINVAL,
                       "--temperature: expected " SP_GPT2_TEMPERATURE_RULE);
  sp_model *m = NULL;
  sp_gpt2 *g = NULL;
  sp_gpt2_acts *a = NULL;
  held h = {0};
  float *lp = NULL;
  int rc = sp_model_load_file(o->model_path, &m, d);
  if (rc == 0) rc = sp_gpt2_new(m, &g, d);
  h.m = m;
  if (rc == 0) rc = load_all(&h, o->ckpt_file, d);
  if (rc == 0 && (rc = sp_gpt2_acts_new(g, 1, (size_t)g->ctx, &a)) != 0)
    sp_diag_set(d, rc, "activations: %s", sp_strerror(rc));
  const char *prompt = o->prompt && *o->prompt ? o->prompt : "\n";
  size_t plen = strlen(prompt), n = plen + o->tokens;
  int32_t *text = rc == 0 ? malloc(n * sizeof *text) : NULL;
  lp = rc == 0 ? malloc((size_t)g->V * sizeof *lp) : NULL;
  if (rc == 0 && (!text || !lp)) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t i = 0; rc == 0 && i < plen; i++) {
    text[i] = (unsigned char)prompt[i];
    if (text[i] >= g->V) text[i] = 0;
    put(out, text[i]);
  }
  sp_gpt2_io io = {h_param, NULL, h_dtype, h_buffer, h_bdtype, &h};
  uint64_t seed = o->seed;
  for (size_t len = plen; rc == 0 && len < n; len++) {
    /* the last context's worth; the activations are sized for a full
     * context, and a shorter window uses their first rows */
    size_t T = len < (size_t)g->ctx ? len : (size_t)g->ctx;
    a->T = T;
    memcpy(a->tok, text + len - T, T * sizeof *text);
    memset(a->tgt, 0, T * sizeof *a->tgt);
    double loss;
    rc = sp_gpt2_embed_forward(g, &io, a, d);
    for (int64_t l = 0; rc == 0 && l < g->n_layer; l++)
      rc = sp_gpt2_block_forward(g, (size_t)l, &io, a, d);
    if (rc == 0) rc = sp_gpt2_head_forward(g, &io, a, 1.0, &loss, d);
    if (rc != 0) break;
    sp_gpt2_last_logprobs(g, a, 0, lp);
    double mx = -INFINITY, sum = 0;
    int32_t pick = 0;
    for (int64_t j = 0; j < g->V; j++)
      if (lp[j] > mx) {
        mx = lp[j];
        pick = (int32_t)j;
      }
    if (o->temperature > 0) {
      /* softmax(logprobs / temperature), then the inverse CDF */
      for (int64_t j = 0; j < g->V; j++)
        sum += exp(((double)lp[j] - mx) / o->temperature);
      double u = (double)(next(&seed) >> 11) * 0x1p-53 * sum, acc = 0;
      pick = (int32_t)g->V - 1;
      for (int64_t j = 0; j < g->V; j++) {
        acc += exp(((double)lp[j] - mx) / o->temperature);
        if (u < acc) {
          pick = (int32_t)j;
          break;
        }
      }
    }
    text[len] = pick;
    put(out, pick);
  }
  fputc('\n', out);
  free(text);
  free(lp);
  held_free(&h);
  sp_gpt2_acts_free(a);
  sp_gpt2_free(g);
  sp_model_free(m);
  return rc;
}
