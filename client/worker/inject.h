/* Fault injection for shardplane-worker (--inject KIND:KEY=VAL,...): the
 * faults a hang diagnosis must explain, made on purpose so that tests and
 * operators can see what the coordinator says about each. Off unless a
 * --inject is given; then only the faults naming this rank act.
 *
 *   stall:rank=R,step=S[,unit=U,phase=forward|backward]
 *       the training thread blocks before that collective (the first
 *       unit collective of step S, of unit U, in that phase) while the
 *       session's heartbeats go on; for ever, until the process is
 *       killed or the job aborted
 *   skip-collective:rank=R,step=S[,unit=U]
 *       the rank skips one all-gather (the first of step S, of unit U): a
 *       real desynchronisation, its peers wait in a collective it never
 *       joins
 *   wrong-count:rank=R,step=S
 *       the first reduction of step S runs (and is reported) with one
 *       element fewer than its peers'
 *   slow:rank=R,factor=F
 *       every step is F times slower: after each, the rank sleeps F - 1
 *       times the step's measured time
 *   exit:rank=R,step=S
 *       the process dies (_exit(1), no cleanup) as step S begins
 *
 * Steps are numbered from 1, as the worker's "step S/N" lines. Threads:
 * everything here runs on the training thread. */
#ifndef SP_WORKER_INJECT_H
#define SP_WORKER_INJECT_H

#include <stdbool.h>
#include <stdint.h>

#include "lib/shardplane.h"

#define SP_INJECT_MAX 16

typedef enum sp_inject_kind {
  SP_INJECT_STALL = 0,
  SP_INJECT_SKIP,
  SP_INJECT_WRONG_COUNT,
  SP_INJECT_SLOW,
  SP_INJECT_EXIT,
} sp_inject_kind;

typedef struct sp_inject_fault {
  sp_inject_kind kind;
  uint32_t rank;
  uint64_t step; /* 0 for slow */
  bool has_unit;
  uint32_t unit;
  sp_fsdp_phase phase; /* SP_PHASE_OTHER: any */
  double factor;       /* slow */
  bool fired;
} sp_inject_fault;

typedef struct sp_inject {
  sp_inject_fault faults[SP_INJECT_MAX];
  size_t n;
  /* set by sp_inject_start */
  sp_session *s;
  uint32_t rank;
  uint64_t step; /* the step being trained, from 1 */
  bool hooks;    /* a fault of this rank acts on collectives */
  double slow;   /* this rank's factor; 1: none */
} sp_inject;

/* Adds the fault of one --inject value. SP_EINVAL with `--inject "SPEC":
 * ...` naming what is wrong (an unknown kind or key, a key missing or
 * given twice, a bad value), or more than SP_INJECT_MAX faults. */
int sp_inject_parse(sp_inject *in, const char *spec, sp_diag *d);
/* Once the session is open: keeps what concerns rank (s borrowed, for
 * the abort a stall waits for). */
void sp_inject_start(sp_inject *in, sp_session *s, uint32_t rank);
/* As step `step` (from 1) begins: an exit fault of that step ends the
 * process here. */
void sp_inject_step(sp_inject *in, uint64_t step);
/* After a step that took `seconds`: the slow fault's sleep. */
void sp_inject_after_step(const sp_inject *in, double seconds);
/* sp_fsdp_opts.before_collective, user an sp_inject (NULL hook when
 * sp_inject_wants_hook says no, so that no fault costs nothing). */
int sp_inject_before_collective(void *user, sp_fsdp_phase phase,
                                sp_comm_kind comm, sp_coll_op op, uint32_t unit,
                                uint64_t *count);
bool sp_inject_wants_hook(const sp_inject *in);

#endif
