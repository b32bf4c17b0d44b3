/* The hosts' agents and the job's incarnations (coord_agents.c):
 * AgentSession and ListIncarnations. A new incarnation is announced on the
 * hub's bus (SP_COORD_EV_INCARNATION) for every area to start afresh.
 *
 * The module owns the agents' streams and the incarnation records.
 * Threads: the loop thread only. */
#ifndef SP_COORD_AGENTS_H
#define SP_COORD_AGENTS_H

#include <stdbool.h>

#include "coord_bus.h"
#include "coord_db.h"
#include "coordinator.h"

/* From sp_coord_new (SP_ENOMEM). */
int sp_coord_agents_register(sp_coord *c);
/* Ends the agents' streams; returns true if `closed` will run (once, when
 * the decision timer is released). */
bool sp_coord_agents_shutdown(sp_coord *c, uv_close_cb closed);
void sp_coord_agents_free(sp_coord *c);

/* An incarnation's record read back from a state dir (a hook of
 * coord_persist.h), in order of number (SP_EFORMAT for one out of order
 * or bounds). */
int sp_coord_agents_restore(sp_coord *c, const sp_coord_db_incarnation *r);

/* The current incarnation's number (0 first, also for a job whose workers
 * no agent started) and the restarts made so far. */
void sp_coord_agents_incarnation(const sp_coord *c, uint64_t *number,
                                 uint32_t *restarts);

/* Subscribers (coord_bus.h). ALERT: every registered agent is told
 * (AGENT_ALERT), to print it beside its workers' output. COMPLETED: the
 * current incarnation's record says so, for good, and an agent that
 * registers later is told AGENT_END, completed. */
int sp_coord_agents_alert(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_agents_completed(sp_coord *c, void *user, const sp_coord_event *e);

#endif
