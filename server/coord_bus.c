/* The subscribers of each kind of event, kept in the order the hub
 * subscribed them. */
#include "coord_bus.h"

#include "base/sp_error.h"
#include "coordinator.h"

int sp_coord_bus_subscribe(sp_coord *c, sp_coord_event_kind kind,
                           sp_coord_event_fn fn, void *user) {
  sp_coord_bus *b = &c->bus;
  if ((unsigned)kind >= SP_COORD_EV_N || fn == NULL) return SP_EINVAL;
  if (b->n[kind] == SP_COORD_BUS_MAX) return SP_ETOOBIG;
  b->sub[kind][b->n[kind]].fn = fn;
  b->sub[kind][b->n[kind]].user = user;
  b->n[kind]++;
  return 0;
}

int sp_coord_bus_announce(sp_coord *c, const sp_coord_event *e) {
  const sp_coord_bus *b = &c->bus;
  int first = 0;
  for (size_t i = 0; i < b->n[e->kind]; i++) {
    int rc = b->sub[e->kind][i].fn(c, b->sub[e->kind][i].user, e);
    if (rc != 0 && first == 0) first = rc;
  }
  return first;
}
