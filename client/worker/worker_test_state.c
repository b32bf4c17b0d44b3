/* The worker's --test-state (worker_test_state.h). It reaches into the
 * runtime's internal registration (lib/fsdp/fsdp_internal.h) as the
 * optimizer in the library does; a trainer outside the build tree has no
 * such access. */
#include "worker_test_state.h"

#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "lib/fsdp/fsdp_internal.h"

struct sp_test_state {
  sp_fsdp *f;
  uint8_t **per_unit; /* float32, c elements per unit with data */
  float *tmp;         /* the master as float32, when it is not */
};

int sp_test_state_new(sp_fsdp *f, const char *name, sp_test_state **out,
                      sp_diag *d) {
  *out = NULL;
  if (f->mem->device)
    return sp_diag_set(d, SP_EUNSUPPORTED, "--test-state \"%s\": only on "
                       "host storage (--device cpu or cpu-staged)", name);
  sp_test_state *ts = calloc(1, sizeof *ts);
  if (!ts) return sp_diag_set(d, SP_ENOMEM, "no memory");
  ts->f = f;
  ts->per_unit = calloc(f->n_units, sizeof *ts->per_unit);
  int64_t most = 1;
  int rc = ts->per_unit ? 0 : sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t u = 0; rc == 0 && u < f->n_units; u++) {
    if (!f->units[u].has_data) continue;
    if (f->units[u].c > most) most = f->units[u].c;
    ts->per_unit[u] = sp_fsdp_xcalloc((size_t)f->units[u].c, sizeof(float));
    if (!ts->per_unit[u]) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  if (rc == 0) {
    ts->tmp = calloc((size_t)most, sizeof(float));
    if (!ts->tmp) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  if (rc == 0)
    rc = sp_fsdp_register_shard_state(f, name, SP_FLOAT32, ts->per_unit, d);
  if (rc < 0) {
    sp_test_state_free(ts);
    return rc;
  }
  *out = ts;
  return 0;
}

int sp_test_state_step(sp_test_state *ts, sp_diag *d) {
  sp_fsdp *f = ts->f;
  for (uint32_t u = 0; u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    size_t n = (size_t)fu->c;
    const float *p = (const float *)fu->shard;
    if (fu->u->dtype != SP_FLOAT32) {
      int rc = sp_cast(ts->tmp, SP_FLOAT32, fu->shard, fu->u->dtype, n);
      if (rc < 0)
        return sp_diag_set(d, rc, "--test-state: unit %u: cast", u);
      p = ts->tmp;
    }
    float *s = (float *)ts->per_unit[u];
    for (size_t i = 0; i < n; i++) s[i] = 0.5f * s[i] + p[i];
  }
  return 0;
}

void sp_test_state_free(sp_test_state *ts) {
  if (!ts) return;
  for (size_t u = 0; ts->per_unit && u < ts->f->n_units; u++)
    free(ts->per_unit[u]);
  free(ts->per_unit);
  free(ts->tmp);
  free(ts);
}
