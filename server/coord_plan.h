/* Plan and model queries (coord_plan.c): GetJob, GetPlan, LocateParam,
 * ListModules, ListBuffers, GetModelSpec. Threads: the loop thread only. */
#ifndef SP_COORD_PLAN_H
#define SP_COORD_PLAN_H

#include "coordinator.h"

int sp_coord_plan_register(sp_coord *c);

#endif
