/* The flight recorders (coord_dump.c): GetTrace and GetDump, and the dump
 * written to the dump dir on a fault or an abort: the ranks' recorders
 * pulled down their Session streams (FLIGHT_DUMP) and put together with
 * the coordinator's view as one JSON document (format
 * shardplane.dump/v1, docs/wire-protocol.md).
 *
 * The module owns the gatherings under way (c->traces).
 * Threads: the loop thread only. */
#ifndef SP_COORD_DUMP_H
#define SP_COORD_DUMP_H

#include "coord_bus.h"
#include "coordinator.h"

int sp_coord_dump_register(sp_coord *c);
/* Pending gatherings end: their calls are answered UNAVAILABLE. */
void sp_coord_dump_shutdown(sp_coord *c);

/* Subscribers (coord_bus.h). SESSION_UP_DONE: a FlightRecord a rank sent
 * up (untrusted: capped). FAULT, ABORTED: gathers every attached rank's
 * recorder and writes the dump to the dump dir (when one is set), naming
 * the reason. Asynchronous. */
int sp_coord_dump_flight(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_dump_write(sp_coord *c, void *user, const sp_coord_event *e);

#endif
