/* Hang diagnosis: what the coordinator concludes from the events the ranks
 * stream, live and without any collective of its own. One file per
 * detector: desync (coord_desync.c: members of one communicator disagree
 * on the fingerprint at one seq), stall (coord_stall.c: no rank moves; who
 * the others wait for) and straggler (coord_straggler.c: a rank whose own
 * compute is slower than the job's median); the job's state, its victims
 * (a rank that fails because a peer did), progress and the verdict in
 * plain words are coord_verdict.c's.
 *
 * This file's module (coord_diag.c) holds what they share: the record of
 * what each rank did (its last event, the collectives it issued and
 * completed on each communicator, the times of its steps), written from
 * the ranks' events and read by the detectors; the communicators'
 * membership; the words the verdicts are made of; and the detectors'
 * period, announced as SP_COORD_EV_TICK.
 *
 * Threads: the loop thread only. The module owns the record, one
 * allocation for the world that each incarnation makes afresh (read it
 * through sp_coord_diag_ranks each time). */
#ifndef SP_COORD_DIAG_H
#define SP_COORD_DIAG_H

#include <stdbool.h>
#include <stddef.h>
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

/* The communicator kinds a rank is a member of: the world, and
 * HYBRID_SHARD's shard and replica groups. */
#define SP_DIAG_KINDS 3
/* Issued collectives a rank remembers per communicator kind, to say which
 * side of a desync it is on. */
#define SP_DIAG_RANK_RING 4u

/* One collective's fingerprint. */
typedef struct sp_coord_diag_fprint {
  uint64_t seq, count;
  uint32_t unit;
  uint8_t op, dtype;
} sp_coord_diag_fprint;

/* What a rank did on one communicator kind. */
typedef struct sp_coord_diag_comm {
  sp_coord_diag_fprint issued; /* the last issued */
  uint64_t issued_ms;          /* coordinator clock */
  uint64_t done_seq;           /* the last completed */
  uint32_t index;              /* comm_index */
  sp_coord_diag_fprint ring[SP_DIAG_RANK_RING];
} sp_coord_diag_comm;

/* The record of one rank, as of its events since it attached. */
typedef struct sp_coord_diag_rank {
  uint64_t last_event_ms;
  bool active; /* sent any event since it attached */
  /* its last transition, for "rank 3's last event: ..." */
  uint8_t last_machine, last_state;
  uint32_t last_unit;
  uint64_t last_step;
  /* the kinds the strategy has (sp_coord_diag_topo.n_kinds): a job of
   * another strategy than HYBRID_SHARD keeps only the world's, a third of
   * the state per rank */
  sp_coord_diag_comm *comm;
  /* step timing from the worker's clock: a step's own time is its length
   * less the time its training thread was blocked waiting for collectives
   * (the completions' waited_us), that is for its peers */
  uint64_t step_start_us, cur_step, wait_us;
  /* the longest silence between its transitions (its clock): in the
   * step under way, and the most of its recent steps (decaying by a tenth
   * a step, so that a slow start is forgotten); what "still moving" is
   * judged against */
  uint64_t last_t_us;
  float gap_cur_ms, gap_max_ms;
  float step_ms[SP_DIAG_STEP_WINDOW], busy_ms[SP_DIAG_STEP_WINDOW];
  uint8_t n_steps, next;
  /* a step began in the message being read: announced (SP_COORD_EV_STEP)
   * once the waits of the one it closed, which the message carries after
   * its transitions, are taken off; and how many steps the message closed
   * (at most 255 counted) */
  bool judge_due;
  uint8_t n_closed;
  float busy_med;
  float busy_lo; /* its 25th percentile: how fast its faster steps are */
} sp_coord_diag_rank;

/* The communicators of the job: the world, and with HYBRID_SHARD n_shard
 * shard groups of shard_world ranks and n_replica replica groups of
 * n_shard ranks. */
typedef struct sp_coord_diag_topo {
  uint32_t world, shard_world, n_shard, n_replica;
  int n_kinds; /* SP_DIAG_KINDS with HYBRID_SHARD, else 1 */
} sp_coord_diag_topo;

/* The number of members of a communicator of kind. */
static inline uint32_t sp_coord_diag_n_members(const sp_coord_diag_topo *t,
                                               int kind) {
  return kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD     ? t->shard_world
         : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA ? t->n_shard
                                                           : t->world;
}

/* The i-th member (i < n_members) of communicator (kind, index), in rank
 * order. */
static inline uint32_t sp_coord_diag_member(const sp_coord_diag_topo *t,
                                            int kind, uint32_t index,
                                            uint32_t i) {
  return kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD
             ? index * t->shard_world + i
         : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA
             ? i * t->shard_world + index
             : i;
}

/* From sp_coord_new / sp_coord_listen / sp_coord_free. Errors: SP_ENOMEM. */
int sp_coord_diag_init(struct sp_coord *c);
void sp_coord_diag_start(struct sp_coord *c);
/* Closes the timer; `closed` runs once it is released (the handle's data
 * is the coordinator). */
void sp_coord_diag_shutdown(struct sp_coord *c, void (*closed)(void *));
void sp_coord_diag_free(struct sp_coord *c);

const sp_coord_diag_topo *sp_coord_diag_topology(const struct sp_coord *c);
/* The world's records, indexed by rank. */
const sp_coord_diag_rank *sp_coord_diag_ranks(const struct sp_coord *c);
/* Whether q is a collective of a communicator rank is a member of, with a
 * seq: the ones the record and the detectors count. */
bool sp_coord_diag_counts(const struct sp_coord *c, uint32_t rank,
                          const Shardplane__V1__Collective *q);

/* The stall threshold in force now, ms. */
uint64_t sp_coord_diag_stall_threshold(const struct sp_coord *c);
/* The silence forgiven every rank because the coordinator's loop paused
 * (its tick came late), in total: a stall verdict comes that much later. */
uint64_t sp_coord_diag_forgiven_ms(const struct sp_coord *c);
/* Every rank not among the culprits cul[0..nc) that is still attached,
 * into out (room for the world); how many. */
size_t sp_coord_diag_others(const struct sp_coord *c, const uint32_t *cul,
                            size_t nc, uint32_t *out);

/* Opens an alert of kind naming rank, every other attached rank its
 * victim, its evidence from evidence_ms (coord_alerts.h). */
void sp_coord_diag_open_alert(struct sp_coord *c,
                              Shardplane__V1__AlertKind kind, uint32_t rank,
                              const char *msg, uint64_t evidence_ms);

/* The k-th smallest of v[0..n) (k < n), reordering v; any n. */
float sp_coord_diag_select(float *v, size_t n, size_t k);
/* The median and the p-th percentile of v[0..n) (n at most
 * SP_DIAG_STEP_WINDOW; 0 when n is 0). */
float sp_coord_diag_median(const float *v, size_t n);
float sp_coord_diag_pct(const float *v, size_t n, double p);

/* Words. Verdicts are cut at SP_DIAG_MAX (what the alert log keeps). */
void sp_coord_diag_say(char *out, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
const char *sp_coord_diag_op_name(uint8_t op);
/* A unit's FQN ("root" for the root unit, "?" out of range). */
const char *sp_coord_diag_unit_name(const struct sp_coord *c, uint32_t unit);
/* "world", "shard group 1", "replica group 0". */
void sp_coord_diag_comm_label(int kind, uint32_t index, char *out, size_t cap);
/* "rank 3" / "ranks 0-2, 4-7" */
void sp_coord_diag_fmt_ranks(const uint32_t *v, size_t n, char *out,
                             size_t cap);
/* "ALL_GATHER of unit 7 (h.6), bfloat16 x 1024" */
void sp_coord_diag_fp_words(const struct sp_coord *c,
                            const sp_coord_diag_fprint *f, char *out,
                            size_t cap);
/* A rank's last event in words ("FORWARD of unit 6, step 120"). */
void sp_coord_diag_last_event(const struct sp_coord *c, uint32_t rank,
                              char *out, size_t cap);
/* An Alert.collective for f on communicator (kind, index). */
void sp_coord_diag_collective_msg(Shardplane__V1__Collective *m,
                                  const sp_coord_diag_fprint *f, int kind,
                                  uint32_t index);

/* Subscribers (coord_bus.h): the record follows the ranks' events
 * (ATTACHED: afresh; TRANSITION; COLLECTIVE; SESSION_UP_DONE: the step
 * the message closed, announced as SP_COORD_EV_STEP; RANK_INFO: the step
 * percentiles) and starts afresh with an incarnation (SP_ENOMEM). */
int sp_coord_diag_attached(struct sp_coord *c, void *user,
                           const sp_coord_event *e);
int sp_coord_diag_transition(struct sp_coord *c, void *user,
                             const sp_coord_event *e);
int sp_coord_diag_collective(struct sp_coord *c, void *user,
                             const sp_coord_event *e);
int sp_coord_diag_session_up_done(struct sp_coord *c, void *user,
                                  const sp_coord_event *e);
int sp_coord_diag_rank_info(struct sp_coord *c, void *user,
                            const sp_coord_event *e);
int sp_coord_diag_new_incarnation(struct sp_coord *c, void *user,
                                  const sp_coord_event *e);

#endif
