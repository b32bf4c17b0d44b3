/* The job's state and the verdict (coord_verdict.c): WAITING until every
 * rank attached, RUNNING, COMPLETED once every rank detached, FAILED with
 * the first verdict; the culprit the first fault named and the victims
 * that failed after it; progress; and the answers built from them:
 * GetVerdict (`shardplane why`), the state, verdict and progress of
 * GetJob and of the dump, and ListRanks' victim fields. The detectors
 * report their verdicts here (sp_coord_verdict_fault), which announces
 * the fault (SP_COORD_EV_FAULT: the dump) and the job's completion
 * (SP_COORD_EV_COMPLETED: the agents' record).
 *
 * The module owns the job's state, its verdict strings and a few figures
 * per rank. Threads: the loop thread only. */
#ifndef SP_COORD_VERDICT_H
#define SP_COORD_VERDICT_H

#include <stdbool.h>
#include <stdint.h>

#include "coord_alerts.h"
#include "coord_bus.h"
#include "coordinator.h"

/* From sp_coord_new / sp_coord_free (SP_ENOMEM). */
int sp_coord_verdict_init(sp_coord *c);
int sp_coord_verdict_register(sp_coord *c);
void sp_coord_verdict_free(sp_coord *c);

Shardplane__V1__JobState sp_coord_verdict_state(const sp_coord *c);
/* The rank the first fault named (a stall's, a desync's, the first rank
 * lost): true with *rank set, false while there is none. */
bool sp_coord_verdict_culprit(const sp_coord *c, uint32_t *rank);
/* A stall or desync verdict (msg), naming culprit when culprit_known: it
 * is the job's culprit unless one was named before; a stall ends the job
 * under --on-stall abort (every rank gets msg as its ABORT), unless the
 * job's replica groups continue (the culprit's group is dropped then,
 * whatever --on-stall says); the dump is written either way. */
void sp_coord_verdict_fault(sp_coord *c, const char *msg, bool culprit_known,
                            uint32_t culprit, bool stall);
/* Read back from a state dir (coord_agents.c): the job had COMPLETED, at
 * the restored ranks' last step; it stays so. */
void sp_coord_verdict_restore_completed(sp_coord *c);
/* Progress alone (GetJob's), without the scans of the ranks GetJob's
 * other fields take. */
void sp_coord_verdict_progress(const sp_coord *c, Shardplane__V1__Progress *p);
/* GetJob's state, verdict and progress; the strings live in c. */
void sp_coord_verdict_job(sp_coord *c, Shardplane__V1__GetJobResponse *r,
                          Shardplane__V1__Progress *p);

/* What `shardplane why` says (GetVerdict, the dashboard's /api/v1/job):
 * the headline; the text, one open alert a line ("STALL: ..."), else the
 * headline; the open alerts, aged as of now or, once the job ended, as of
 * its end (borrowed until the next alert or listing); whether the job is
 * healthy (not FAILED, no alert open). */
typedef struct sp_coord_why {
  bool healthy;
  char headline[SP_DIAG_MAX];
  char text[8192];
  Shardplane__V1__Alert *open[SP_COORD_ALERTS_MAX_OPEN];
  size_t n_open;
} sp_coord_why;
void sp_coord_verdict_why(sp_coord *c, sp_coord_why *w);
/* Whether rank was lost after the job's culprit's fault (a victim, kept
 * when it attaches again), and the culprit in *of (may be NULL). */
bool sp_coord_verdict_victim(const sp_coord *c, uint32_t rank, uint32_t *of);

/* Subscribers (coord_bus.h). ATTACHING: refused after the job ended ("the
 * job ended (COMPLETED at step 20); start a new coordinator"). ATTACHED:
 * RUNNING once every rank is. DETACHED: COMPLETED once every rank is.
 * LOST: the rank is the culprit (a LOST alert) or a victim of an earlier
 * fault; the others' ABORT names the culprit. SESSION_UP: the loss and
 * the total steps a rank reports. ABORTED: FAILED with its reason. TICK:
 * progress. RANK_INFO: victim, victim_of. INCARNATION: WAITING again,
 * everything afresh (SP_ENOMEM). */
int sp_coord_verdict_refuse_attach(sp_coord *c, void *user,
                                   const sp_coord_event *e);
int sp_coord_verdict_attached(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_verdict_detached(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_verdict_lost(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_verdict_session_up(sp_coord *c, void *user,
                                const sp_coord_event *e);
int sp_coord_verdict_aborted(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_verdict_tick(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_verdict_rank_info(sp_coord *c, void *user,
                               const sp_coord_event *e);
int sp_coord_verdict_new_incarnation(sp_coord *c, void *user,
                                     const sp_coord_event *e);

#endif
