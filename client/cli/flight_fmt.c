/* The words of a flight-recorder event (flight_fmt.h). */
#include "flight_fmt.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

void sp_flight_time(uint64_t t_us, char *buf, size_t len) {
  time_t s = (time_t)(t_us / 1000000);
  struct tm tm;
  if (gmtime_r(&s, &tm) == NULL) {
    snprintf(buf, len, "?");
    return;
  }
  snprintf(buf, len, "%02d:%02d:%02d.%06u", tm.tm_hour, tm.tm_min, tm.tm_sec,
           (unsigned)(t_us % 1000000));
}

void sp_flight_op_words(const char *op, char *buf, size_t len) {
  if (len == 0) return;
  size_t i = 0;
  for (; op != NULL && op[i] != '\0' && i + 1 < len; i++)
    buf[i] = op[i] == '_' ? '-' : (char)tolower((unsigned char)op[i]);
  buf[i] = '\0';
}

void sp_flight_collective(const sp_flight_event *e, char *buf, size_t len) {
  char op[32], fqn[160] = "";
  sp_flight_op_words(e->op, op, sizeof op);
  if (e->fqn != NULL && e->fqn[0] != '\0')
    snprintf(fqn, sizeof fqn, " (%s)", e->fqn);
  char comm[48];
  /* the world is one group; a shard or replica group needs its index */
  if (e->comm != NULL && strcmp(e->comm, "world") == 0)
    snprintf(comm, sizeof comm, "world");
  else
    snprintf(comm, sizeof comm, "%s %u", e->comm ? e->comm : "?",
             e->comm_index);
  snprintf(buf, len, "%s #%" PRIu64 " %s unit %u%s %s x %" PRIu64, op, e->seq,
           comm, e->unit, fqn, e->dtype ? e->dtype : "?", e->count);
}

void sp_flight_line(const sp_flight_event *e, char *buf, size_t len) {
  char t[32];
  sp_flight_time(e->t_us, t, sizeof t);
  if (!e->collective) {
    bool handle = e->machine != NULL && strcmp(e->machine, "handle") == 0;
    char unit[200] = "";
    if (handle)
      snprintf(unit, sizeof unit, " unit %u%s%s%s", e->unit,
               e->fqn && e->fqn[0] ? " (" : "", e->fqn ? e->fqn : "",
               e->fqn && e->fqn[0] ? ")" : "");
    snprintf(buf, len, "%s step %" PRIu64 " %s%s%s", t, e->step,
             handle ? "" : "root ", e->state ? e->state : "?", unit);
    return;
  }
  char c[320], what[48] = "issued";
  sp_flight_collective(e, c, sizeof c);
  if (e->completed && e->after_us >= 0)
    snprintf(what, sizeof what, "completed after %.1f ms",
             (double)e->after_us / 1000.0);
  else if (e->completed)
    snprintf(what, sizeof what, "completed");
  snprintf(buf, len, "%s step %" PRIu64 " %s %s", t, e->step, c, what);
}

void sp_fmt_ranges(FILE *f, const uint32_t *idx, size_t n) {
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j + 1 < n && idx[j + 1] == idx[j] + 1) j++;
    fprintf(f, "%s%u", i ? "," : "", idx[i]);
    if (j > i) fprintf(f, "-%u", idx[j]);
    i = j + 1;
  }
}
