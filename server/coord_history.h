/* The job's time series for the dashboard (coord_history.c): a sample a
 * second of the job's progress, throughput, step times, attached ranks
 * and open alerts, taken on the detectors' tick (SP_COORD_EV_TICK) while
 * the job waits or runs, and once more when it ended.
 *
 * Bounded: at most SP_COORD_HISTORY_CAP samples. When they are full, every
 * other one is dropped and samples are taken half as often from then on,
 * so the whole job stays on the chart at an even spacing, coarser the
 * longer it runs (4,096 samples at 1 s: 68 minutes; then 2 s, ...).
 *
 * The series goes on across incarnations: a restart is part of the job's
 * story (the step falls back to the checkpoint's, the ranks attach again),
 * which an operator looking at the chart wants to see rather than lose;
 * each sample carries its incarnation.
 *
 * The module owns the samples (one allocation at start). Threads: the
 * loop thread only. */
#ifndef SP_COORD_HISTORY_H
#define SP_COORD_HISTORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_bus.h"
#include "coordinator.h"

#define SP_COORD_HISTORY_CAP 4096u
#define SP_COORD_HISTORY_PERIOD_MS 1000u

typedef struct sp_coord_history_sample {
  uint64_t t_ms; /* the coordinator's clock (ms since it started) */
  uint64_t step; /* the slowest attached rank's */
  uint64_t incarnation;
  double loss; /* NaN: none reported */
  double steps_per_s, tokens_per_s;
  /* over the attached ranks' recent steps (SP_DIAG_STEP_WINDOW each);
   * 0: no step timed yet */
  float step_p50_ms, step_p99_ms;
  uint32_t attached, open_alerts;
  uint8_t state; /* Shardplane__V1__JobState */
} sp_coord_history_sample;

/* From sp_coord_new / sp_coord_free. SP_ENOMEM. */
int sp_coord_history_init(sp_coord *c);
void sp_coord_history_free(sp_coord *c);

/* A subscriber of SP_COORD_EV_TICK (coord_bus.h), after the verdict's
 * (the steps per second it keeps): a sample when one is due. */
int sp_coord_history_tick(sp_coord *c, void *user, const sp_coord_event *e);

/* The samples, oldest first: how many, and the i-th (i < count), borrowed
 * until the next tick. The period between them now (ms). */
size_t sp_coord_history_count(const sp_coord *c);
const sp_coord_history_sample *sp_coord_history_at(const sp_coord *c, size_t i);
uint64_t sp_coord_history_period_ms(const sp_coord *c);

/* The step time percentiles (ms) over the recent steps of every attached
 * rank (the diag record's windows), within about 2 %: a histogram of 32
 * buckets an octave, one pass over the world without sorting. 0 and 0
 * when no rank has timed a step. */
void sp_coord_history_step_pcts(const sp_coord *c, float *p50, float *p99);

#endif
