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

/* The job's incarnation now (0: the first) and the restarts since this
 * job began (across the coordinator's restarts on a state dir). */
void sp_coord_agents_incarnation(const sp_coord *c, uint64_t *number,
                                 uint32_t *restarts);

/* Whether the current incarnation is ending for a restart: ranks that
 * leave now (a stop's SIGTERM makes shardplane-worker checkpoint and
 * detach) have not finished the job. */
bool sp_coord_agents_restarting(const sp_coord *c);

/* Subscribers (coord_bus.h). ALERT: every registered agent is told
 * (AGENT_ALERT), to print it beside its workers' output. COMPLETED: the
 * current incarnation's record says so, for good, and an agent that
 * registers later is told AGENT_END, completed. */
int sp_coord_agents_alert(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_agents_completed(sp_coord *c, void *user, const sp_coord_event *e);
/* TICK: a node not registered again within the reattach grace of the
 * coordinator's restart no longer holds up a restart; an elastic job's
 * wait for more hosts ends. */
int sp_coord_agents_tick(sp_coord *c, void *user, const sp_coord_event *e);

/* Replica groups that continue (coord_quorum.h): the ranks of every host
 * (registered agent) holding any of ranks lo..hi, widened into *lo_out..
 * *hi_out (which start as lo..hi); and AGENT_RESTART, with why, to each
 * such host's agent. */
void sp_coord_agents_hosts_of(const sp_coord *c, uint32_t lo, uint32_t hi,
                              uint32_t *lo_out, uint32_t *hi_out);
void sp_coord_agents_restart(sp_coord *c, uint32_t lo, uint32_t hi,
                             const char *why);

#endif
