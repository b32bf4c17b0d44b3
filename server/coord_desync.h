/* The desync detector (coord_desync.c): members of one communicator that
 * disagree on the fingerprint (op, unit, dtype, count) of the collective
 * at one seq. Per communicator it keeps the first fingerprint seen at
 * each recent seq; a member that issues another one raises DESYNC within
 * the message that shows it, naming the smaller side; a tie waits for
 * the next member, the other groups' vote, or DESYNC_TIE_MS.
 *
 * The module owns those tables (one per communicator, a ring each, made
 * afresh with every incarnation). Threads: the loop thread only. */
#ifndef SP_COORD_DESYNC_H
#define SP_COORD_DESYNC_H

#include <stdbool.h>
#include <stdint.h>

#include "coord_bus.h"
#include "coord_diag.h"
#include "coordinator.h"

/* From sp_coord_new / sp_coord_free (SP_ENOMEM). */
int sp_coord_desync_init(sp_coord *c);
void sp_coord_desync_free(sp_coord *c);

/* The first fingerprint seen at seq on communicator (kind, index), while
 * it is still kept: true with *f set. */
bool sp_coord_desync_first(const sp_coord *c, int kind, uint32_t index,
                           uint64_t seq, sp_coord_diag_fprint *f);

/* Subscribers (coord_bus.h): each issued collective is compared
 * (COLLECTIVE, after the record has it); a tie still open is settled by
 * its rule (TICK); the tables start afresh (INCARNATION, SP_ENOMEM). */
int sp_coord_desync_collective(sp_coord *c, void *user,
                               const sp_coord_event *e);
int sp_coord_desync_tick(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_desync_new_incarnation(sp_coord *c, void *user,
                                    const sp_coord_event *e);

#endif
