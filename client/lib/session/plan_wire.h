/* A coordinator's plan, rebuilt from its shardplane.v1.Plan answer into the
 * structs of common/plan/plan.h, so the command prints it with the offline
 * renderer and answers shard questions with the plan math in common/ (the
 * functions the coordinator itself runs). */
#ifndef SP_PLAN_WIRE_H
#define SP_PLAN_WIRE_H

#include "plan/job.h"
#include "plan/memory.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* The model holds only what a Plan message carries: one module per unit,
 * one parameter per flattened entry, the buffers. Strings are borrowed from
 * the message, which the wire plan owns. */
typedef struct sp_wire_plan {
  Shardplane__V1__Plan *msg;
  sp_model model;
  sp_plan plan;
  sp_job job; /* the job as asked (plan.strategy is the effective one) */
} sp_wire_plan;

/* Takes ownership of msg (freed by sp_wire_plan_free, also on error).
 * SP_EFORMAT, with the reason in diag, when the message is inconsistent
 * (a unit out of place, a shape over SP_MAX_DIMS, an alias of nothing, no
 * job); SP_ENOMEM. */
int sp_wire_plan_new(Shardplane__V1__Plan *msg, sp_wire_plan **out,
                     sp_diag *diag);
void sp_wire_plan_free(sp_wire_plan *wp);

/* A wire DType as sp_dtype (the numbers are equal); SP_DTYPE_INVALID for
 * values this build does not know. */
sp_dtype sp_wire_dtype(int v);

/* Copies a Job message into job (initialised by the caller). SP_ENOMEM,
 * SP_ETOOBIG. */
int sp_wire_job(const Shardplane__V1__Job *m, sp_job *job);

/* A Plan's memory estimate (GetPlan with_memory) as the model's struct.
 * SP_EFORMAT, naming what, when it is missing, has other categories than
 * this build's (by name, in sp_mem_cat order) or an unknown optimizer. */
int sp_wire_memory(const Shardplane__V1__MemoryEstimate *m,
                   sp_mem_estimate *out, sp_diag *diag);

#endif
