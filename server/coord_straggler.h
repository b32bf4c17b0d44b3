/* The straggler detector (coord_straggler.c): a rank whose own time per
 * step (the step less its waits on peers, from the workers' clocks) stays
 * over the job's median by the straggler ratio for SP_DIAG_STRAGGLER_STEPS
 * steps opens a STRAGGLER alert naming it, the others its victims; the
 * alert closes once it is back within half the margin.
 *
 * The module owns the job's median and each rank's score. Threads: the
 * loop thread only. */
#ifndef SP_COORD_STRAGGLER_H
#define SP_COORD_STRAGGLER_H

#include "coord_bus.h"
#include "coordinator.h"

/* From sp_coord_new / sp_coord_free (SP_ENOMEM). */
int sp_coord_straggler_init(sp_coord *c);
void sp_coord_straggler_free(sp_coord *c);

/* Subscribers (coord_bus.h): the job's median and every rank judged
 * against it (TICK); a rank judged at its step's close (STEP); its score
 * afresh (ATTACHED); ListRanks' straggler_score (RANK_INFO); everything
 * afresh (INCARNATION, SP_ENOMEM). */
int sp_coord_straggler_tick(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_straggler_step(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_straggler_attached(sp_coord *c, void *user,
                                const sp_coord_event *e);
int sp_coord_straggler_rank_info(sp_coord *c, void *user,
                                 const sp_coord_event *e);
int sp_coord_straggler_new_incarnation(sp_coord *c, void *user,
                                       const sp_coord_event *e);

/* Rank's own time per step over the job's median, as last judged (0
 * before it closed a step): ListRanks' straggler_score, without the rest
 * of a RankInfo, for readers of every rank at once (the dashboard). */
float sp_coord_straggler_score(const sp_coord *c, uint32_t rank);

#endif
