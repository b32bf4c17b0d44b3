/* The MLP's activations (mlp.h): one layout for the allocation and the
 * memory model's count (train_memory.h). */
#include <stdint.h>
#include <stdlib.h>

#include "mlp.h"

/* n x dim floats' count (at least one), or SP_ETOOBIG when their bytes
 * overflow. */
static int float_count(size_t n, int64_t dim, size_t *count) {
  if (dim < 0 || (dim > 0 && n > SIZE_MAX / sizeof(float) / (size_t)dim))
    return SP_ETOOBIG;
  *count = n * (size_t)dim;
  if (*count == 0) *count = 1;
  return 0;
}

float *sp_mlp_floats(size_t n, int64_t dim, int *rc) {
  size_t count = 0;
  int r = float_count(n, dim, &count);
  float *p = r == 0 ? calloc(count, sizeof(float)) : NULL;
  if (p == NULL) *rc = r ? r : SP_ENOMEM;
  return p;
}

/* n x dim floats counted in cat and, when real, allocated; NULL with *rc
 * set (nothing done when it is set already). */
static float *floats(sp_mlp_acts *a, bool real, sp_act_cat cat, size_t n,
                     int64_t dim, int *rc) {
  size_t count = 0;
  if (*rc != 0 || (*rc = float_count(n, dim, &count)) != 0) return NULL;
  sp_act_bytes_add(&a->mem, cat, (uint64_t)count * sizeof(float));
  return real ? sp_mlp_floats(n, dim, rc) : NULL;
}

/* The layout: every layer's input kept for backward, the output, two
 * gradient scratches and the targets. */
static int layout(const sp_mlp *mlp, size_t n, bool real, sp_mlp_acts *a) {
  a->n = n;
  /* NULL-terminated, so sp_mlp_acts_free and the model check need no
   * layer count of their own */
  a->x = calloc(mlp->n_layers + 2, sizeof *a->x);
  int rc = a->x == NULL ? SP_ENOMEM : 0;
  for (size_t l = 0; l <= mlp->n_layers && rc == 0; l++) {
    int64_t dim = l == 0 ? mlp->in_dim : mlp->layers[l - 1].out;
    a->x[l] = floats(a, real, SP_ACT_SAVED, n, dim, &rc);
  }
  a->dx = floats(a, real, SP_ACT_SCRATCH, n, mlp->max_dim, &rc);
  a->dy = floats(a, real, SP_ACT_SCRATCH, n, mlp->max_dim, &rc);
  a->t = floats(a, real, SP_ACT_SCRATCH, n, mlp->out_dim, &rc);
  return rc;
}

int sp_mlp_acts_new(const sp_mlp *mlp, size_t n, sp_mlp_acts **out) {
  if (mlp == NULL || out == NULL) return SP_EINVAL;
  *out = NULL;
  sp_mlp_acts *a = calloc(1, sizeof *a);
  if (a == NULL) return SP_ENOMEM;
  int rc = layout(mlp, n, true, a);
  if (rc != 0) {
    sp_mlp_acts_free(a);
    return rc;
  }
  *out = a;
  return 0;
}

void sp_mlp_acts_free(sp_mlp_acts *a) {
  if (a == NULL) return;
  if (a->x != NULL)
    for (size_t l = 0; a->x[l] != NULL; l++) free(a->x[l]);
  free(a->x);
  free(a->dx);
  free(a->dy);
  free(a->t);
  free(a);
}

int sp_mlp_acts_count(const sp_mlp *mlp, size_t n, sp_act_bytes *out) {
  if (mlp == NULL || out == NULL) return SP_EINVAL;
  sp_mlp_acts a = {0};
  int rc = layout(mlp, n, false, &a);
  free(a.x);
  *out = a.mem;
  return rc;
}
