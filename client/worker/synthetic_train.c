/* The synthetic-gradient cycle (synthetic_train.h). */
#include "synthetic_train.h"

#include "plan/model.h"
#include "plan/plan.h"

int sp_synthetic_step(sp_fsdp *f, sp_session *s, uint64_t step, double lr,
                      sp_diag *d) {
  const sp_plan *pl = sp_session_plan(s);
  const sp_model *m = sp_session_model(s);
  sp_session_set_step(s, step + 1); /* reported from 1 */
  int rc = sp_fsdp_root_pre_forward(f, d);
  for (uint32_t u = 1; rc == 0 && u < pl->n_units; u++) {
    rc = sp_fsdp_pre_forward(f, u, d);
    if (rc == 0) rc = sp_fsdp_post_forward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_root_post_forward(f, d);
  if (rc == 0) rc = sp_fsdp_root_pre_backward(f, d);
  for (uint32_t u = (uint32_t)pl->n_units; rc == 0 && u-- > 0;) {
    if (u) rc = sp_fsdp_pre_backward(f, u, d);
    /* gradient = 0.01 * parameter: deterministic, rank-independent */
    for (size_t p = 0; rc == 0 && p < m->n_params; p++) {
      if (pl->param_unit[p] != (int32_t)u) continue;
      void *g = sp_fsdp_param_grad(f, (int32_t)p);
      const void *v = sp_fsdp_param(f, (int32_t)p);
      if (!g || !v) continue;
      sp_dtype dt = sp_fsdp_param_dtype(f, (int32_t)p);
      size_t n = (size_t)m->params[p].numel, es = sp_dtype_size(dt);
      /* memcpy on the CPU, a device copy on a GPU */
      rc = sp_fsdp_copy(f, g, v, n * es, d);
    }
    if (rc == 0) rc = sp_fsdp_post_backward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_finish_backward(f, d);
  if (rc == 0) rc = sp_fsdp_sgd_step(f, lr * 0.01, d);
  /* the step's device work is part of its duration */
  if (rc == 0) rc = sp_fsdp_synchronize(f, d);
  return rc;
}
