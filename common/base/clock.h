/* The monotonic clock, in seconds, for timing steps, timeouts and
 * benchmarks; and the wall clock in milliseconds, for times people read
 * (records, the dashboard). */
#ifndef SP_CLOCK_H
#define SP_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Seconds on CLOCK_MONOTONIC (arbitrary origin). */
static inline double sp_clock_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Milliseconds since the Unix epoch on CLOCK_REALTIME. */
static inline uint64_t sp_clock_unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#endif
