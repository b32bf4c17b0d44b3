/* One line per flight-recorder event, the same words in `shardplane trace`
 * (events from a FlightRecord) and `shardplane analyze` (events from a
 * dump file), so an operator who reads one reads the other. */
#ifndef SP_CLI_FLIGHT_FMT_H
#define SP_CLI_FLIGHT_FMT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct sp_flight_event {
  uint64_t t_us; /* worker clock, microseconds since the epoch */
  uint64_t step;
  bool collective;
  /* collective */
  const char *comm; /* "world", "shard", "replica" */
  uint32_t comm_index;
  uint64_t seq;
  const char *op; /* "ALL_GATHER" */
  const char *dtype;
  uint64_t count;
  bool completed;
  int64_t after_us; /* completed: time since its issue, -1 unknown */
  /* transition */
  const char *machine; /* "root", "handle" */
  const char *state;
  /* both */
  uint32_t unit;
  const char *fqn; /* the unit's module, NULL or "" unknown */
} sp_flight_event;

/* "12:03:41.123456" (UTC): the workers' clocks are wall clocks. */
void sp_flight_time(uint64_t t_us, char *buf, size_t len);
/* "all-gather" for "ALL_GATHER". */
void sp_flight_op_words(const char *op, char *buf, size_t len);
/* "all-gather #413 world unit 7 (transformer.h.6) bfloat16 x 1048576":
 * a collective's fingerprint in words. */
void sp_flight_collective(const sp_flight_event *e, char *buf, size_t len);
/* The whole line, without a newline:
 * "12:03:41.123456 step 120 FORWARD unit 6",
 * "12:03:41.123456 step 120 all-gather #413 world unit 7 ... issued",
 * "... completed after 2.1 ms". */
void sp_flight_line(const sp_flight_event *e, char *buf, size_t len);

/* Ascending indices as "0-2,5,7-9". */
void sp_fmt_ranges(FILE *f, const uint32_t *idx, size_t n);

#endif
