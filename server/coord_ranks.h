/* Ranks and their sessions (coord_ranks.c): Attach, Detach, the Session
 * stream, ReportTransition, ListRanks, Abort and the heartbeat check.
 * Every reported transition is checked against the FSDP state tables
 * (common/plan/state.h). What happens to a rank is announced on the
 * hub's bus (coord_bus.h: attached, lost, its transitions, collectives
 * and messages, ...), not told to the areas that act on it.
 *
 * The module owns the rank table (the hub's c->ranks, world_size entries,
 * allocated at start), each rank's Session stream and the abort in force.
 * Threads: the loop thread only. */
#ifndef SP_COORD_RANKS_H
#define SP_COORD_RANKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_bus.h"
#include "coord_db.h"
#include "coordinator.h"

/* From sp_coord_new: the rank table (SP_ENOMEM), then the methods. */
int sp_coord_ranks_init(sp_coord *c);
int sp_coord_ranks_register(sp_coord *c);
/* Elastic nodes (sp_coord_set_world), before c->plan becomes pl: a table
 * for pl's world, every rank never attached; the old table's open
 * streams are ended. SP_ENOMEM leaves the old table. */
int sp_coord_ranks_resize(sp_coord *c, const sp_plan *pl);
/* Starts the heartbeat check (from sp_coord_listen). */
void sp_coord_ranks_start(sp_coord *c);
/* Ends the sessions and closes the heartbeat timer; `closed` runs once the
 * timer handle is released. */
void sp_coord_ranks_shutdown(sp_coord *c, uv_close_cb closed);
void sp_coord_ranks_free(sp_coord *c);

/* What the other areas read of a rank; the strings are borrowed until the
 * rank changes. */
typedef struct sp_coord_rank_view {
  int status; /* Shardplane__V1__RankStatus */
  const char *host;
  uint32_t pid;
  uint64_t step, last_heard_ms;
  int root;
  sp_rpc_call *session; /* NULL: no open stream */
  /* the trainer's last report (SessionUp; 0: none) */
  uint64_t tokens_per_step, mem_bytes, mem_peak_bytes, mem_predicted_bytes;
  /* the largest scheduling gap it reported lately (ms), and whether its
   * loss is being withheld now (alive on a host under pressure) */
  uint32_t sched_gap_ms;
  bool loss_withheld;
} sp_coord_rank_view;
void sp_coord_ranks_get(const sp_coord *c, uint32_t rank,
                        sp_coord_rank_view *v);
int sp_coord_ranks_status(const sp_coord *c, uint32_t rank);
bool sp_coord_ranks_attached(const sp_coord *c, uint32_t rank);
uint64_t sp_coord_ranks_step(const sp_coord *c, uint32_t rank);
/* QUORUM with the replica quorum's new epoch down every open Session
 * stream (coord_quorum.h). */
void sp_coord_ranks_send_quorum(sp_coord *c, uint64_t epoch);
/* How many ranks have that status now (kept as they change: O(1)). */
uint32_t sp_coord_ranks_with_status(const sp_coord *c, int status);
/* Summary counts for GetJob / status. */
void sp_coord_ranks_summary(const sp_coord *c, Shardplane__V1__RankSummary *s,
                            uint32_t *by_state, size_t n_states);

/* ABORT down every open Session stream with the reason and, when known,
 * the culprit; streams that bind later get it too and no rank attaches
 * any more. Returns how many streams it reached. */
uint32_t sp_coord_ranks_abort_all(sp_coord *c, const char *reason,
                                  bool has_culprit, uint32_t culprit);

/* Durability (the hooks of coord_persist.h): writes the ranks whose
 * snapshot changed; restores one rank as a state dir had it. */
void sp_coord_ranks_snapshot(sp_coord *c);
int sp_coord_ranks_restore(sp_coord *c, const sp_coord_db_rank *r);

/* Subscribers (coord_bus.h). ALERT_LOGGED: each culprit counts the alert,
 * and its snapshot goes with the log entry. INCARNATION: every rank's
 * Session stream of the last one is ended (ABORTED, why), every rank is to
 * attach afresh, and the last incarnation's abort is forgotten. */
int sp_coord_ranks_alert_logged(sp_coord *c, void *user,
                                const sp_coord_event *e);
int sp_coord_ranks_new_incarnation(sp_coord *c, void *user,
                                   const sp_coord_event *e);
/* WORKERS_ALIVE: each of the node's ranks notes that its process was seen
 * alive now, with its host's pressure (what the heartbeat check weighs
 * before declaring it lost); an attached rank the agent does not list has
 * no process and is lost at once. WORKER_EXITED: the rank, attached, is
 * lost at once (its stream's end usually said so first). */
int sp_coord_ranks_workers_alive(sp_coord *c, void *user,
                                 const sp_coord_event *e);
int sp_coord_ranks_worker_exited(sp_coord *c, void *user,
                                 const sp_coord_event *e);

#endif
