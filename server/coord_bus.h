/* The hub's wiring: what one area of the coordinator announces and the
 * areas that act on it hear, without either calling the other. An area
 * announces an event; the hub (coord.c) subscribed, at start, the areas
 * that act on it, in the order they are to run.
 *
 * Threads: the loop thread only. Subscribers run inside the call that
 * announces, one after the other, and may announce events themselves;
 * what an event points to is borrowed for the call. */
#ifndef SP_COORD_BUS_H
#define SP_COORD_BUS_H

#include <stddef.h>
#include <stdint.h>

#include "shardplane/v1/coordinator.pb-c.h"

struct sp_coord;

typedef enum sp_coord_event_kind {
  /* coord_ranks.c. A rank asks to attach: a subscriber that refuses it
   * returns non-zero with the reason in out (cap bytes). */
  SP_COORD_EV_ATTACHING,
  /* rank attached afresh (not a reattach); rank detached */
  SP_COORD_EV_ATTACHED,
  SP_COORD_EV_DETACHED,
  /* rank was lost, text saying why, evidence_ms when the evidence of it
   * began (its silence: when it was last heard; a broken stream: now):
   * the subscribers write the ABORT the other ranks get in out (cap
   * bytes) and the rank it names in *culprit (preset to rank) */
  SP_COORD_EV_LOST,
  /* rank applied transition, a legal one */
  SP_COORD_EV_TRANSITION,
  /* rank's SessionUp up: after its transitions, then each of its
   * collectives (collective, all read at now_ms), then after them */
  SP_COORD_EV_SESSION_UP,
  SP_COORD_EV_COLLECTIVE,
  SP_COORD_EV_SESSION_UP_DONE,
  /* an operator's Abort, text its reason */
  SP_COORD_EV_ABORTED,
  /* rank's ListRanks entry info: the subscribers fill in their fields */
  SP_COORD_EV_RANK_INFO,
  /* coord_agents.c. A new incarnation begins, text saying so: everything
   * of the last one starts afresh; non-zero: out of memory. */
  SP_COORD_EV_INCARNATION,
  /* coord_agents.c. A host's agent said which of its node's ranks (rank
   * to rank + n_ranks - 1) have a process alive now and its host's
   * pressure (alive, of the current incarnation; text: its host); a
   * worker of rank exited without being asked to (text: its host). */
  SP_COORD_EV_WORKERS_ALIVE,
  SP_COORD_EV_WORKER_EXITED,
  /* coord_alerts.c. text was written to the alert log, naming culprits
   * (their counts go with it); then alert was published on the Watch
   * streams, evidence_ms when the evidence of a detector's verdict began
   * (sp_coord_alerts_info says for which kinds). */
  SP_COORD_EV_ALERT_LOGGED,
  SP_COORD_EV_ALERT,
  /* coord_diag.c. The detectors' period, at now_ms; rank began a step
   * (its last one closed, its waits taken off), n_closed the steps the
   * message closed: the newest of its record's step_ms window (0 for its
   * first step; more than the window holds: the oldest are gone). */
  SP_COORD_EV_TICK,
  SP_COORD_EV_STEP,
  /* coord_verdict.c. A verdict named a fault, text; every rank finished,
   * at step. */
  SP_COORD_EV_FAULT,
  SP_COORD_EV_COMPLETED,
  SP_COORD_EV_N
} sp_coord_event_kind;

/* Which fields an event carries is said at its kind; the rest are zero. */
typedef struct sp_coord_event {
  sp_coord_event_kind kind;
  uint32_t rank;
  uint64_t now_ms, step;
  const char *text;
  const uint32_t *culprits;
  size_t n_culprits;
  const Shardplane__V1__Transition *transition;
  const Shardplane__V1__SessionUp *up;
  const Shardplane__V1__Collective *collective;
  const Shardplane__V1__Alert *alert;
  uint64_t evidence_ms;
  uint32_t n_closed;
  Shardplane__V1__RankInfo *info;
  const Shardplane__V1__WorkersAlive *alive;
  uint32_t n_ranks;
  char *out;
  size_t cap;
  uint32_t *culprit;
} sp_coord_event;

/* Returns 0, or what the kind says a non-zero return means. */
typedef int (*sp_coord_event_fn)(struct sp_coord *c, void *user,
                                 const sp_coord_event *e);

/* Subscribers of one kind at most. */
#define SP_COORD_BUS_MAX 8u

typedef struct sp_coord_bus {
  struct {
    sp_coord_event_fn fn;
    void *user;
  } sub[SP_COORD_EV_N][SP_COORD_BUS_MAX];
  uint8_t n[SP_COORD_EV_N];
} sp_coord_bus;

/* fn runs, with user, at every event of kind, after the subscribers
 * before it. SP_EINVAL for a kind out of range, SP_ETOOBIG past
 * SP_COORD_BUS_MAX. */
int sp_coord_bus_subscribe(struct sp_coord *c, sp_coord_event_kind kind,
                           sp_coord_event_fn fn, void *user);
/* Runs every subscriber of e->kind; returns the first non-zero return
 * (the others run all the same), else 0. */
int sp_coord_bus_announce(struct sp_coord *c, const sp_coord_event *e);

#endif
