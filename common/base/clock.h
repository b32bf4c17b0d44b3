/* The monotonic clock, in seconds, for timing steps, timeouts and
 * benchmarks. */
#ifndef SP_CLOCK_H
#define SP_CLOCK_H

#include <time.h>

/* Seconds on CLOCK_MONOTONIC (arbitrary origin). */
static inline double sp_clock_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
