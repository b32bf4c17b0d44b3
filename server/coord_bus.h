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
  /* coord_alerts.c */
  SP_COORD_EV_ALERT_LOGGED, /* text written to the alert log, naming
                             * culprits: their counts go with it */
  SP_COORD_EV_ALERT,        /* alert published to the Watch streams */
  SP_COORD_EV_N
} sp_coord_event_kind;

/* Which fields an event carries is said at its kind; the rest are zero. */
typedef struct sp_coord_event {
  sp_coord_event_kind kind;
  uint32_t rank;
  const char *text;
  const uint32_t *culprits;
  size_t n_culprits;
  const Shardplane__V1__Alert *alert;
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
