/* The memory model's prediction for a job the benchmarks run, from the
 * spec and the job's flags, as shardplane-coordinator would plan it. */
#ifndef SP_BENCH_PREDICT_H
#define SP_BENCH_PREDICT_H

#include "base/sp_error.h"
#include "plan/memory.h"

/* Loads the spec at model_path, applies flags (pairs name, value, ...,
 * ended by a NULL name: the coordinator's flag names without "--"; NULL:
 * none), builds the plan
 * and runs sp_mem_estimate_plan with opts (NULL: its defaults) into *out.
 * 0, or the first failure's negative SP_E* code with d saying which step
 * failed and why. Nothing is kept: the spec and the plan are freed. */
int sp_bench_predict(const char *model_path, const char *const *flags,
                     const sp_mem_opts *opts, sp_mem_estimate *out, sp_diag *d);

#endif
