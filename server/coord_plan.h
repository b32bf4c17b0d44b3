/* Plan and model queries (coord_plan.c): GetJob, GetPlan, LocateParam,
 * ListModules, ListBuffers, GetModelSpec. Threads: the loop thread only. */
#ifndef SP_COORD_PLAN_H
#define SP_COORD_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "coordinator.h"

int sp_coord_plan_register(sp_coord *c);

/* One row of the buffer table by FQN, as ListBuffers and the dashboard's
 * /api/v1/buffers show it: buffer i of the plan (i < pl->n_buffers).
 * Borrowed from the plan and its model. */
typedef struct sp_coord_buffer_row {
  const char *fqn;
  const sp_tensor_spec *spec; /* its shape */
  sp_dtype orig_dtype;        /* the spec's */
  sp_dtype compute_dtype;     /* what mixed precision casts it to */
  uint32_t owner_unit;        /* the innermost unit that owns it */
  bool persistent;
} sp_coord_buffer_row;
void sp_coord_plan_buffer_row(const sp_plan *pl, size_t i,
                              sp_coord_buffer_row *r);

/* A page of the buffers whose FQN begins with prefix (NULL or "": all),
 * in model order: from the start-th of them on, at most cap indices into
 * pl->buffers in idx, how many in *n. Returns how many match in all
 * (the next page, if any, starts at start + *n). */
size_t sp_coord_plan_buffer_page(const sp_plan *pl, const char *prefix,
                                 size_t start, size_t cap, size_t *idx,
                                 size_t *n);

#endif
