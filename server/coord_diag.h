/* Hang diagnosis (coord_diag.c): what the coordinator concludes from the
 * events the ranks stream, live and without any collective of its own.
 * Desync (members of one communicator disagree on the fingerprint at one
 * seq), stall (no rank moves; who the others wait for), straggler (a rank
 * whose own compute is slower than the job's median), victims (a rank that
 * fails because a peer did), the job's state and progress, and the verdict
 * in plain words. Everything runs on the coordinator's loop thread. */
#ifndef SP_COORD_DIAG_H
#define SP_COORD_DIAG_H

#include <stdbool.h>
#include <stdint.h>

#include "coord_bus.h"
#include "shardplane/v1/coordinator.pb-c.h"

struct sp_coord;
typedef struct sp_coord_diag sp_coord_diag;

/* Policy and thresholds (sp_coord_config.diag). Zeros are the defaults. */
typedef struct sp_coord_diag_config {
  /* A rank with no event for this long is stalled; 0: adaptive,
   * max(SP_DIAG_STALL_FLOOR_MS, SP_DIAG_STALL_K x the job's p99 step). */
  uint32_t stall_timeout_ms;
  bool abort_on_stall; /* --on-stall abort: the verdict ends the job */
  /* A rank whose median own time per step (the step less its waits on
   * peers) is this many times the job's median is a straggler; 0: 1.3. */
  double straggler_ratio;
  const char *dump_dir; /* NULL: no dump written on abort or stall */
} sp_coord_diag_config;

#define SP_DIAG_STALL_FLOOR_MS 10000u
#define SP_DIAG_STALL_K 5u
/* How often the detectors run over the ranks. */
#define SP_DIAG_TICK_MS 200u
/* Step times kept per rank (percentiles, straggler window). */
#define SP_DIAG_STEP_WINDOW 16u
/* Steps a rank must stay over the straggler bar before it is named. */
#define SP_DIAG_STRAGGLER_STEPS 4u
/* Events of one FlightRecord the coordinator keeps (the rest: dropped,
 * oldest first), and the most ranks whose records one dump gathers at
 * once. */
#define SP_DIAG_MAX_FLIGHT_EVENTS 4096u
/* How long GetTrace / GetDump wait for the ranks' recorders. */
#define SP_DIAG_TRACE_WAIT_MS 3000u

/* From sp_coord_new / sp_coord_listen / sp_coord_free. Errors: SP_ENOMEM. */
int sp_coord_diag_init(struct sp_coord *c);
int sp_coord_diag_register(struct sp_coord *c);
void sp_coord_diag_start(struct sp_coord *c);
/* Closes the timer; `closed` runs once it is released (the handle's data
 * is the coordinator). */
void sp_coord_diag_shutdown(struct sp_coord *c, void (*closed)(void *));
void sp_coord_diag_free(struct sp_coord *c);
/* The rank the first fault named (a stall's, a desync's, the first rank
 * lost): true with *rank set, false while there is none. */
bool sp_coord_diag_culprit(const struct sp_coord *c, uint32_t *rank);
/* Read back from a state dir (coord_agents.c): the job had COMPLETED, at
 * the restored ranks' last step; it stays so. */
void sp_coord_diag_restore_completed(struct sp_coord *c);

/* Subscribers (coord_bus.h), of the ranks' events (ATTACHING: refused
 * after the job ended, "the job ended (COMPLETED at step 20); start a new
 * coordinator"; LOST: decides whether the rank is the culprit, a LOST
 * alert, or a victim of an earlier fault, and names the culprit to the
 * others; the rest as they say) and of a new incarnation (every table,
 * verdict and rank figure starts afresh, the job WAITING again;
 * SP_ENOMEM). */
int sp_coord_diag_refuse_attach(struct sp_coord *c, void *user,
                                const sp_coord_event *e);
int sp_coord_diag_attached(struct sp_coord *c, void *user,
                           const sp_coord_event *e);
int sp_coord_diag_detached(struct sp_coord *c, void *user,
                           const sp_coord_event *e);
int sp_coord_diag_lost(struct sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_diag_transition(struct sp_coord *c, void *user,
                             const sp_coord_event *e);
int sp_coord_diag_session_up(struct sp_coord *c, void *user,
                             const sp_coord_event *e);
int sp_coord_diag_collective(struct sp_coord *c, void *user,
                             const sp_coord_event *e);
int sp_coord_diag_session_up_done(struct sp_coord *c, void *user,
                                  const sp_coord_event *e);
int sp_coord_diag_aborted(struct sp_coord *c, void *user,
                          const sp_coord_event *e);
int sp_coord_diag_rank_info(struct sp_coord *c, void *user,
                            const sp_coord_event *e);
int sp_coord_diag_new_incarnation(struct sp_coord *c, void *user,
                                  const sp_coord_event *e);

/* GetJob's state, verdict and progress; the strings live in c. */
void sp_coord_diag_job(struct sp_coord *c, Shardplane__V1__GetJobResponse *r,
                       Shardplane__V1__Progress *p);
/* The stall threshold in force now, ms. */
uint64_t sp_coord_diag_stall_threshold(const struct sp_coord *c);
/* The silence forgiven every rank because the coordinator's loop paused
 * (its tick came late), in total: a stall verdict comes that much later. */
uint64_t sp_coord_diag_forgiven_ms(const struct sp_coord *c);
/* Bytes the diagnosis keeps per rank and per communicator (the bench). */
size_t sp_coord_diag_bytes(const struct sp_coord *c);
/* The verdict (GetVerdict): headline and text in the caller's buffers. */
bool sp_coord_diag_verdict(struct sp_coord *c, char *headline, size_t hcap,
                           char *text, size_t tcap);
/* The open alerts (oldest first), borrowed until the next alert. */
size_t sp_coord_diag_open_alerts(struct sp_coord *c,
                                 Shardplane__V1__Alert **out, size_t cap);
/* A rank's last event in words ("FORWARD of unit 6, step 120"). */
void sp_coord_diag_last_event(const struct sp_coord *c, uint32_t rank,
                              char *out, size_t cap);

#endif
