/* Alerts (coord_alerts.c): every alert the coordinator raises is counted,
 * kept in a ring of the recent ones (GetJob, the dump), written to the
 * state dir's alert log, logged and published: to the Watch streams, and
 * as SP_COORD_EV_ALERT to what the hub subscribed (the agents, which
 * print it beside their workers' output). The ones a detector opens stay
 * open, their age current, until it closes them (GetVerdict). The module
 * owns the ring, the open alerts and the strings they point to.
 *
 * Threads: the loop thread only. */
#ifndef SP_COORD_ALERTS_H
#define SP_COORD_ALERTS_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_bus.h"
#include "coordinator.h"

/* Alerts kept for status; older ones are only counted. */
#define SP_COORD_ALERTS_RECENT 32
/* Alerts kept open at most; a new one past them drops the oldest. */
#define SP_COORD_ALERTS_MAX_OPEN 16u
/* Where the seconds of an aged alert go in its template. */
#define SP_COORD_ALERTS_AGE "\x1f"

typedef struct sp_coord_alerts sp_coord_alerts;

/* An alert of a kind with its culprits (the first is Alert.rank) and
 * victims; the arrays are copied. */
typedef struct sp_coord_alerts_info {
  Shardplane__V1__AlertKind kind;
  const uint32_t *culprits, *victims;
  size_t n_culprits, n_victims;
  const Shardplane__V1__Collective *collective; /* may be NULL */
  /* sp_coord_alerts_open only: an alert that says how long something has
   * lasted ("waiting in it for 10 s") keeps its text with
   * SP_COORD_ALERTS_AGE where the seconds go, and since when, so that it
   * is current whenever it is read (NULL: no age) */
  const char *tmpl;
  uint64_t since_ms;
  /* When the evidence a detector judged began (coordinator clock,
   * sp_coord_base_now_ms), so that the time from a fault to its diagnosis
   * can be measured (/metrics). Set by the detectors for their kinds:
   * stall, when the first of the silent ranks fell silent; lost, when the
   * rank was last heard (its stream breaking: the break); desync, when
   * the first fingerprint that differs arrived; straggler, when its step
   * first crossed the bar of the stretch that named it. Not read for the
   * other kinds (an illegal transition is its own evidence; an operator's
   * abort is none). */
  uint64_t evidence_ms;
} sp_coord_alerts_info;

/* From sp_coord_new / sp_coord_free. SP_ENOMEM. */
int sp_coord_alerts_init(sp_coord *c);
void sp_coord_alerts_free(sp_coord *c);

/* Records an alert: counted, kept in the ring and the alert log (the
 * culprits' counts follow it there: SP_COORD_EV_ALERT_LOGGED), logged,
 * published. */
void sp_coord_alerts_raise(sp_coord *c, const sp_coord_alerts_info *in,
                           const char *msg);
/* An illegal transition (a rank given) or an operator's abort
 * (UINT32_MAX), raised with its words. */
void sp_coord_alerts_raisef(sp_coord *c, uint32_t rank, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Raises an alert and keeps it open until closed. */
void sp_coord_alerts_open(sp_coord *c, const sp_coord_alerts_info *in,
                          const char *msg);
/* Closes the open alerts of kind: all of them, or those of rank. */
void sp_coord_alerts_close(sp_coord *c, Shardplane__V1__AlertKind kind,
                           bool any_rank, uint32_t rank);
/* A subscriber of SP_COORD_EV_INCARNATION (coord_bus.h): every open
 * alert closes (a new incarnation's are its own). */
int sp_coord_alerts_new_incarnation(sp_coord *c, void *user,
                                    const sp_coord_event *e);
/* The open alerts (oldest first), their ages as of as_of_ms; borrowed
 * until the next alert or listing. */
size_t sp_coord_alerts_list_open(sp_coord *c, uint64_t as_of_ms,
                                 Shardplane__V1__Alert **out, size_t cap);
/* tmpl with its SP_COORD_ALERTS_AGE replaced by secs, into out. */
void sp_coord_alerts_render_age(const char *tmpl, double secs, char *out,
                                size_t cap);

/* Every alert raised, also before a restart. */
uint64_t sp_coord_alerts_total(const sp_coord *c);
/* The recent ones, oldest first, borrowed until the next alert. */
size_t sp_coord_alerts_recent(sp_coord *c, Shardplane__V1__Alert **out,
                              size_t cap);

/* One alert of the log read back from a state dir (the newest
 * SP_COORD_ALERTS_RECENT, oldest first); SP_EFORMAT for one out of
 * bounds. Then the count of all. */
int sp_coord_alerts_restore(sp_coord *c, uint32_t rank, int kind,
                            const char *msg, size_t len, uint64_t time_ms);
void sp_coord_alerts_restored(sp_coord *c, uint64_t total);

#endif
