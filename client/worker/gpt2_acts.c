/* The GPT-2 step's activations (gpt2_acts.h). */
#include "gpt2_acts.h"

#include <stdint.h>
#include <stdlib.h>

/* ------------------------------------------------------------------ */
/* activations                                                         */
/* ------------------------------------------------------------------ */

int sp_gpt2_step_alloc(const sp_gpt2_ops *ops, int64_t n, int64_t m, size_t es,
                       void **out, sp_diag *d) {
  *out = NULL;
  if (n < 0 || m < 0 || (m > 0 && n > ops->max_elems / m))
    return sp_diag_set(d, SP_ETOOBIG,
                       "%lld x %lld elements: over 2^31 a "
                       "tensor",
                       (long long)n, (long long)m);
  return ops->alloc((size_t)(n * m > 0 ? n * m : 1) * es, out, d);
}

/* n x m elements of es bytes counted into a->bytes, or NULL with *rc set
 * (nothing done when it is set already). */
static void *array(const sp_gpt2_ops *ops, sp_gpt2_acts *a, int64_t n,
                   int64_t m, size_t es, int *rc, sp_diag *d) {
  void *p = NULL;
  if (*rc != 0) return NULL;
  *rc = sp_gpt2_step_alloc(ops, n, m, es, &p, d);
  if (*rc == 0) a->bytes += (uint64_t)(n * m > 0 ? n * m : 1) * es;
  return p;
}

static float *floats(const sp_gpt2_ops *ops, sp_gpt2_acts *a, int64_t n,
                     int64_t m, int *rc, sp_diag *d) {
  return array(ops, a, n, m, sizeof(float), rc, d);
}

/* the per-layer lists, for allocation and release alike */
#define N_LISTS 13
static float ***list(sp_gpt2_acts *a, size_t i) {
  float ***all[N_LISTS] = {
      &a->res,      &a->ln1,  &a->ln1_mean, &a->ln1_rstd, &a->qkv,
      &a->att,      &a->atty, &a->res2,     &a->ln2,      &a->ln2_mean,
      &a->ln2_rstd, &a->fch,  &a->fch_gelu};
  return all[i];
}

int sp_gpt2_step_acts_alloc(const sp_gpt2_ops *ops, const sp_gpt2 *g, size_t B,
                            size_t T, sp_gpt2_acts *a, sp_diag *d) {
  int64_t max = ops->max_elems, Ti = (int64_t)T;
  if (B > (size_t)(max / Ti) || (int64_t)B * g->n_head > max / Ti / Ti)
    return sp_diag_set(d, SP_ETOOBIG,
                       "activations of %zu x %zu tokens: "
                       "over 2^31 elements",
                       B, T);
  a->B = B;
  a->T = T;
  int64_t N = (int64_t)(B * T), C = g->C, L = g->n_layer, NH = g->n_head;
  int rc = 0;
  for (size_t i = 0; i < N_LISTS && rc == 0; i++) {
    *list(a, i) = calloc((size_t)L + 2, sizeof(float *)); /* NULL-ended */
    if (*list(a, i) == NULL) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  for (int64_t l = 0; l < L && rc == 0; l++) {
    a->res[l] = floats(ops, a, N, C, &rc, d);
    a->ln1[l] = floats(ops, a, N, C, &rc, d);
    a->ln1_mean[l] = floats(ops, a, N, 1, &rc, d);
    a->ln1_rstd[l] = floats(ops, a, N, 1, &rc, d);
    a->qkv[l] = floats(ops, a, N, 3 * C, &rc, d);
    a->att[l] = floats(ops, a, (int64_t)B * NH * Ti, Ti, &rc, d);
    a->atty[l] = floats(ops, a, N, C, &rc, d);
    a->res2[l] = floats(ops, a, N, C, &rc, d);
    a->ln2[l] = floats(ops, a, N, C, &rc, d);
    a->ln2_mean[l] = floats(ops, a, N, 1, &rc, d);
    a->ln2_rstd[l] = floats(ops, a, N, 1, &rc, d);
    a->fch[l] = floats(ops, a, N, 4 * C, &rc, d);
    a->fch_gelu[l] = floats(ops, a, N, 4 * C, &rc, d);
  }
  if (rc == 0) a->res[L] = floats(ops, a, N, C, &rc, d);
  a->lnf = floats(ops, a, N, C, &rc, d);
  a->lnf_mean = floats(ops, a, N, 1, &rc, d);
  a->lnf_rstd = floats(ops, a, N, 1, &rc, d);
  a->probs = floats(ops, a, N, g->V, &rc, d);
  a->dres = floats(ops, a, N, C, &rc, d);
  a->dbuf = floats(ops, a, N, C, &rc, d);
  a->dbig = floats(ops, a, N, 4 * C, &rc, d);
  a->dqkv = floats(ops, a, N, 3 * C, &rc, d);
  a->datt = floats(ops, a, ops->datt_all_heads ? NH * Ti : Ti, Ti, &rc, d);
  /* the largest param: wte [V, C], wpe [ctx, C] or a [4C, C] matrix */
  int64_t wmax = g->V * C;
  if (g->ctx * C > wmax) wmax = g->ctx * C;
  if (4 * C * C > wmax) wmax = 4 * C * C;
  a->w = floats(ops, a, wmax, 1, &rc, d);
  a->gw = floats(ops, a, wmax, 1, &rc, d);
  a->lnw = floats(ops, a, C, 1, &rc, d);
  a->lnb = floats(ops, a, C, 1, &rc, d);
  a->gb = floats(ops, a, 4 * C, 1, &rc, d);
  a->gb2 = floats(ops, a, 4 * C, 1, &rc, d);
  a->tok = array(ops, a, N, 1, sizeof *a->tok, &rc, d);
  a->tgt = array(ops, a, N, 1, sizeof *a->tgt, &rc, d);
  a->allow = array(ops, a, Ti, Ti, 1, &rc, d);
  return rc;
}

void sp_gpt2_step_acts_release(const sp_gpt2_ops *ops, sp_gpt2_acts *a) {
  for (size_t i = 0; i < N_LISTS; i++) {
    float **l = *list(a, i);
    for (size_t j = 0; l && l[j]; j++) ops->release(l[j]);
    free(l);
  }
  void *single[] = {a->lnf,  a->lnf_mean, a->lnf_rstd, a->probs, a->dres,
                    a->dbuf, a->dbig,     a->dqkv,     a->datt,  a->w,
                    a->gw,   a->lnw,      a->lnb,      a->gb,    a->gb2,
                    a->tok,  a->tgt,      a->allow};
  for (size_t i = 0; i < sizeof single / sizeof single[0]; i++)
    ops->release(single[i]);
}
