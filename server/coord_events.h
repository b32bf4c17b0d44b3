/* Watch (coord_events.c): a server stream of events (attached, lost,
 * detached, alerts and, when asked for, transitions), filtered by rank and
 * kind. The module owns the list of Watch streams.
 *
 * Threads: the loop thread only. */
#ifndef SP_COORD_EVENTS_H
#define SP_COORD_EVENTS_H

#include <stdint.h>

#include "coordinator.h"

int sp_coord_events_register(sp_coord *c);
/* Ends every Watch stream (UNAVAILABLE). */
void sp_coord_events_shutdown(sp_coord *c);
/* Publishes an event to the Watch streams whose filters match. */
void sp_coord_events_publish(sp_coord *c, Shardplane__V1__EventKind kind,
                             uint32_t rank, const char *message,
                             const Shardplane__V1__Transition *t);
/* An ALERT event carrying the alert itself (Event.alert). */
void sp_coord_events_publish_alert(sp_coord *c, const Shardplane__V1__Alert *a);

#endif
