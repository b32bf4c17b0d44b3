/* The GPT-2 step's activations (gpt2_acts.h): one layout for the
 * allocation and the count. */
#include "gpt2_acts.h"

#include <stdint.h>
#include <stdlib.h>

const sp_gpt2_layout sp_gpt2_cpu_layout = {
    .name = "sp_gpt2",
    .max_elems = SP_GPT2_MAX_ELEMS,
    .datt_all_heads = false,
    .wte_rows = true,
    .device_loss = false,
};

const sp_gpt2_layout sp_gpt2_cuda_layout = {
    .name = "sp_gpt2_cuda",
    .max_elems = INT32_MAX,
    .datt_all_heads = true,
    .wte_rows = false,
    .device_loss = true,
};

/* n x m elements of es bytes (at least one element) through alloc, held
 * to lo->max_elems. */
static int alloc_array(const sp_gpt2_layout *lo, sp_gpt2_alloc_fn alloc,
                       int64_t n, int64_t m, size_t es, void **out,
                       sp_diag *d) {
  *out = NULL;
  if (n < 0 || m < 0 || (m > 0 && n > lo->max_elems / m))
    return sp_diag_set(d, SP_ETOOBIG,
                       "%lld x %lld elements: over 2^31 a tensor", (long long)n,
                       (long long)m);
  return alloc((size_t)(n * m > 0 ? n * m : 1) * es, out, d);
}

typedef struct layout_run {
  const sp_gpt2_layout *lo;
  sp_gpt2_alloc_fn alloc;
  sp_gpt2_acts *a;
  int rc;
  sp_diag *d;
} layout_run;

/* n x m elements of es bytes counted in cat, or NULL with r->rc set
 * (nothing done when it is set already). */
static void *array(layout_run *r, sp_act_cat cat, int64_t n, int64_t m,
                   size_t es) {
  void *p = NULL;
  if (r->rc != 0) return NULL;
  r->rc = alloc_array(r->lo, r->alloc, n, m, es, &p, r->d);
  if (r->rc == 0)
    sp_act_bytes_add(&r->a->mem, cat, (uint64_t)(n * m > 0 ? n * m : 1) * es);
  return p;
}

static float *floats(layout_run *r, sp_act_cat cat, int64_t n, int64_t m) {
  return array(r, cat, n, m, sizeof(float));
}

/* the per-layer lists, for allocation and release alike; res first */
#define N_LISTS 13
static float ***list(sp_gpt2_acts *a, size_t i) {
  float ***all[N_LISTS] = {
      &a->res,      &a->ln1,  &a->ln1_mean, &a->ln1_rstd, &a->qkv,
      &a->att,      &a->atty, &a->res2,     &a->ln2,      &a->ln2_mean,
      &a->ln2_rstd, &a->fch,  &a->fch_gelu};
  return all[i];
}

/* One block's activations for layer l: its own, or (checkpointing) the
 * set of layer 0 that every layer shares. */
static void block_arrays(layout_run *r, const sp_gpt2 *g, int64_t l) {
  sp_gpt2_acts *a = r->a;
  if (a->checkpointing && l > 0) {
    for (size_t i = 1; i < N_LISTS; i++) (*list(a, i))[l] = (*list(a, i))[0];
    return;
  }
  sp_act_cat cat = a->checkpointing ? SP_ACT_RECOMPUTE : SP_ACT_SAVED;
  int64_t N = (int64_t)(a->B * a->T), C = g->C, Ti = (int64_t)a->T;
  a->ln1[l] = floats(r, cat, N, C);
  a->ln1_mean[l] = floats(r, cat, N, 1);
  a->ln1_rstd[l] = floats(r, cat, N, 1);
  a->qkv[l] = floats(r, cat, N, 3 * C);
  a->att[l] = floats(r, cat, (int64_t)a->B * g->n_head * Ti, Ti);
  a->atty[l] = floats(r, cat, N, C);
  a->res2[l] = floats(r, cat, N, C);
  a->ln2[l] = floats(r, cat, N, C);
  a->ln2_mean[l] = floats(r, cat, N, 1);
  a->ln2_rstd[l] = floats(r, cat, N, 1);
  a->fch[l] = floats(r, cat, N, 4 * C);
  a->fch_gelu[l] = floats(r, cat, N, 4 * C);
}

/* The float32 copies of params and their gradients. With float32 views the
 * params are read in place and the gradients go into the views: only
 * wpe's (its backward sums positions into ctx x C) and, unless the table
 * adds the lookup's rows in place, wte's lookup share (V x C). Otherwise
 * room for the largest param (wte [V, C], wpe [ctx, C] or a [4C, C]
 * matrix) and wpe's copy beside wte's. */
static void param_scratch(layout_run *r, const sp_gpt2 *g) {
  sp_gpt2_acts *a = r->a;
  const sp_gpt2_layout *lo = r->lo;
  int64_t C = g->C, wmax = g->V * C;
  if (g->ctx * C > wmax) wmax = g->ctx * C;
  if (4 * C * C > wmax) wmax = 4 * C * C;
  bool f32 = a->f32_views;
  a->w = floats(r, SP_ACT_SCRATCH, f32 ? 1 : wmax, 1);
  a->wpe = floats(r, SP_ACT_SCRATCH, f32 ? 1 : g->ctx * C, 1);
  a->gw = floats(r, SP_ACT_SCRATCH, f32 && lo->wte_rows ? g->ctx * C : wmax, 1);
  a->lnw = floats(r, SP_ACT_SCRATCH, C, 1);
  a->lnb = floats(r, SP_ACT_SCRATCH, C, 1);
  a->gb = floats(r, SP_ACT_SCRATCH, 4 * C, 1);
  a->gb2 = floats(r, SP_ACT_SCRATCH, 4 * C, 1);
  if (lo->wte_rows)
    a->wte_row = array(r, SP_ACT_SCRATCH, g->V, 1, sizeof *a->wte_row);
}

static int layout(layout_run *r, const sp_gpt2 *g, const sp_gpt2_shape *sh) {
  sp_gpt2_acts *a = r->a;
  size_t B = sh->B, T = sh->T;
  if (B == 0 || T == 0 || T > (size_t)g->ctx)
    return sp_diag_set(r->d, SP_EINVAL, "%s: %zu x %zu tokens (context %lld)",
                       r->lo->name, B, T, (long long)g->ctx);
  int64_t max = r->lo->max_elems, Ti = (int64_t)T;
  if (B > (size_t)(max / Ti) || (int64_t)B * g->n_head > max / Ti / Ti)
    return sp_diag_set(r->d, SP_ETOOBIG,
                       "activations of %zu x %zu tokens: over 2^31 elements", B,
                       T);
  a->B = B;
  a->T = T;
  a->checkpointing = sh->checkpointing;
  a->f32_views = sh->f32_views;
  int64_t N = (int64_t)(B * T), C = g->C, L = g->n_layer, NH = g->n_head;
  for (size_t i = 0; i < N_LISTS && r->rc == 0; i++) {
    *list(a, i) = calloc((size_t)L + 2, sizeof(float *)); /* NULL-ended */
    if (*list(a, i) == NULL) r->rc = sp_diag_set(r->d, SP_ENOMEM, "no memory");
  }
  for (int64_t l = 0; l <= L && r->rc == 0; l++) {
    a->res[l] = floats(r, SP_ACT_SAVED, N, C);
    if (l < L) block_arrays(r, g, l);
  }
  a->lnf = floats(r, SP_ACT_SAVED, N, C);
  a->lnf_mean = floats(r, SP_ACT_SAVED, N, 1);
  a->lnf_rstd = floats(r, SP_ACT_SAVED, N, 1);
  a->probs = floats(r, SP_ACT_LOGITS, N, g->V);
  a->dres = floats(r, SP_ACT_SCRATCH, N, C);
  a->dbuf = floats(r, SP_ACT_SCRATCH, N, C);
  a->dbig = floats(r, SP_ACT_SCRATCH, N, 4 * C);
  a->dqkv = floats(r, SP_ACT_SCRATCH, N, 3 * C);
  a->datt = floats(r, SP_ACT_SCRATCH, r->lo->datt_all_heads ? NH * Ti : Ti, Ti);
  param_scratch(r, g);
  a->tok = array(r, SP_ACT_SCRATCH, N, 1, sizeof *a->tok);
  a->tgt = array(r, SP_ACT_SCRATCH, N, 1, sizeof *a->tgt);
  a->allow = array(r, SP_ACT_SCRATCH, Ti, Ti, 1);
  if (r->lo->device_loss) {
    a->rows = array(r, SP_ACT_SCRATCH, N, 1, sizeof(double));
    a->total = array(r, SP_ACT_SCRATCH, 1, 1, sizeof(double));
    a->scalar = array(r, SP_ACT_SCRATCH, 1, 1, sizeof(double));
  }
  return r->rc;
}

int sp_gpt2_acts_alloc(const sp_gpt2_layout *lo, sp_gpt2_alloc_fn alloc,
                       const sp_gpt2 *g, const sp_gpt2_shape *sh,
                       sp_gpt2_acts *a, sp_diag *d) {
  layout_run r = {lo, alloc, a, 0, d};
  return layout(&r, g, sh);
}

void sp_gpt2_acts_release(sp_gpt2_release_fn release, sp_gpt2_acts *a) {
  for (size_t i = 0; i < N_LISTS; i++) {
    float **l = *list(a, i);
    /* a shared set (checkpointing) is layer 0's */
    for (size_t j = 0; l && l[j]; j++)
      if (j == 0 || i == 0 || l[j] != l[0]) release(l[j]);
    free(l);
  }
  void *single[] = {a->lnf,  a->lnf_mean, a->lnf_rstd, a->probs, a->dres,
                    a->dbuf, a->dbig,     a->dqkv,     a->datt,  a->w,
                    a->gw,   a->wpe,      a->lnw,      a->lnb,   a->gb,
                    a->gb2,  a->wte_row,  a->tok,      a->tgt,   a->allow,
                    a->rows, a->total,    a->scalar};
  for (size_t i = 0; i < sizeof single / sizeof single[0]; i++)
    if (single[i]) release(single[i]);
}

/* The count's allocator: a valid-looking address that is never read. */
static int no_alloc(size_t bytes, void **out, sp_diag *d) {
  static max_align_t token;
  (void)bytes, (void)d;
  *out = &token;
  return 0;
}

static void no_release(void *p) { (void)p; }

int sp_gpt2_acts_count(const sp_gpt2_layout *lo, const sp_gpt2 *g,
                       const sp_gpt2_shape *sh, sp_act_bytes *out, sp_diag *d) {
  sp_gpt2_acts a = {0};
  int rc = sp_gpt2_acts_alloc(lo, no_alloc, g, sh, &a, d);
  *out = a.mem;
  sp_gpt2_acts_release(no_release, &a);
  return rc;
}
