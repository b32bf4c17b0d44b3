/* The worker's --test-state (worker_test_state.h), registered with the
 * runtime as a trainer's own optimizer would register its moments
 * (sp_fsdp_register_shard_state). */
#include "worker_test_state.h"

#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"

struct sp_test_state {
  sp_fsdp *f;
  const sp_plan *plan;
  uint8_t **per_unit; /* float32, c elements per unit with data */
  float *tmp;         /* the master as float32, when it is not */
};

int sp_test_state_new(sp_fsdp *f, const sp_plan *plan, const char *name,
                      sp_test_state **out, sp_diag *d) {
  *out = NULL;
  if (!sp_fsdp_host_storage(f))
    return sp_diag_set(d, SP_EUNSUPPORTED,
                       "--test-state \"%s\": only on "
                       "host storage (--device cpu or cpu-staged)",
                       name);
  sp_test_state *ts = calloc(1, sizeof *ts);
  if (!ts) return sp_diag_set(d, SP_ENOMEM, "no memory");
  ts->f = f;
  ts->plan = plan;
  ts->per_unit = calloc(plan->n_units, sizeof *ts->per_unit);
  int64_t most = 1;
  int rc = ts->per_unit ? 0 : sp_diag_set(d, SP_ENOMEM, "no memory");
  for (uint32_t u = 0; rc == 0 && u < plan->n_units; u++) {
    int64_t c = 0;
    if (!sp_fsdp_shard(f, u, &c)) continue;
    if (c > most) most = c;
    ts->per_unit[u] = calloc((size_t)c, sizeof(float));
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
  for (uint32_t u = 0; u < ts->plan->n_units; u++) {
    int64_t c = 0;
    const void *shard = sp_fsdp_shard(ts->f, u, &c);
    if (!shard) continue;
    size_t n = (size_t)c;
    sp_dtype dt = ts->plan->units[u].dtype;
    const float *p = (const float *)shard;
    if (dt != SP_FLOAT32) {
      int rc = sp_cast(ts->tmp, SP_FLOAT32, shard, dt, n);
      if (rc < 0) return sp_diag_set(d, rc, "--test-state: unit %u: cast", u);
      p = ts->tmp;
    }
    float *s = (float *)ts->per_unit[u];
    for (size_t i = 0; i < n; i++) s[i] = 0.5f * s[i] + p[i];
  }
  return 0;
}

void sp_test_state_free(sp_test_state *ts) {
  if (!ts) return;
  for (size_t u = 0; ts->per_unit && u < ts->plan->n_units; u++)
    free(ts->per_unit[u]);
  free(ts->per_unit);
  free(ts->tmp);
  free(ts);
}
