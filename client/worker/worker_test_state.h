/* A stand-in optimizer state for tests of checkpoints and resume: one
 * float32 tensor per unit, sharded exactly like the master shards and
 * registered with the runtime, so checkpoints carry it as they will carry
 * a real optimizer's moments. Each step it becomes s = 0.5 s + p (p the
 * master after the step), so it depends on the whole history and on where
 * every element sits. Plain host storage only ("cpu": sp_fsdp_host_storage). */
#ifndef SP_WORKER_TEST_STATE_H
#define SP_WORKER_TEST_STATE_H

#include "lib/shardplane.h"
#include "plan/plan.h"

typedef struct sp_test_state sp_test_state;

/* Allocates the state (zero) for the units of plan, the runtime's, and
 * registers it under name. SP_EUNSUPPORTED unless the runtime's storage
 * is plain host memory (sp_fsdp_host_storage); the runtime must outlive
 * it. */
int sp_test_state_new(sp_fsdp *f, const sp_plan *plan, const char *name,
                      sp_test_state **out, sp_diag *d);
/* s = 0.5 s + p on every element, in float32 (the master cast to float32
 * when it is another dtype). */
int sp_test_state_step(sp_test_state *ts, sp_diag *d);
/* After sp_fsdp_free (the runtime borrows the storage until then). */
void sp_test_state_free(sp_test_state *ts);

#endif
