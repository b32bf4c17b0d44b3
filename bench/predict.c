/* bench/predict.h */
#include "predict.h"

#include <stddef.h>

#include "plan/job.h"
#include "plan/model.h"
#include "plan/plan.h"

int sp_bench_predict(const char *model_path, const char *const *flags,
                     const sp_mem_opts *opts, sp_mem_estimate *out,
                     sp_diag *d) {
  sp_model *m = NULL;
  sp_plan *pl = NULL;
  sp_job job;
  sp_job_init(&job);
  int rc = sp_model_load_file(model_path, &m, d);
  for (size_t i = 0; rc == 0 && flags && flags[i]; i += 2)
    rc = sp_job_apply_flag(&job, flags[i], flags[i + 1], d);
  if (rc == 0) rc = sp_plan_build(m, &job, &pl, d);
  if (rc == 0) rc = sp_mem_estimate_plan(pl, opts, out, d);
  sp_plan_free(pl);
  sp_model_free(m);
  sp_job_clear(&job);
  return rc;
}
