/* The stall detector (coord_stall.c): while the job runs, a rank that
 * sends no event for the stall threshold (sp_coord_diag_stall_threshold)
 * though it heartbeats opens one STALL alert, naming who the others wait
 * for: the members of the collective they wait in that have not issued
 * it (following the chain of waits to its end), every member when all
 * issued it (the network or the collective library), or the silent ranks
 * themselves when nobody is in a collective. The alert closes once every
 * rank moves again.
 *
 * The module owns whether a stall is open. Threads: the loop thread
 * only. */
#ifndef SP_COORD_STALL_H
#define SP_COORD_STALL_H

#include "coord_bus.h"
#include "coordinator.h"

/* From sp_coord_new / sp_coord_free (SP_ENOMEM). */
int sp_coord_stall_init(sp_coord *c);
void sp_coord_stall_free(sp_coord *c);

/* Subscribers (coord_bus.h): the check (TICK); no stall open
 * (INCARNATION). */
int sp_coord_stall_tick(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_stall_new_incarnation(sp_coord *c, void *user,
                                   const sp_coord_event *e);

#endif
