/* The recent alerts (a ring, with what each alert's fields point to) and
 * the open ones (an array, oldest first); an alert reaches the Watch
 * streams and the alert log from here only. */
#include "coord_alerts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_base.h"
#include "coord_bus.h"
#include "coord_events.h"
#include "coord_persist.h"

typedef struct open_alert {
  Shardplane__V1__Alert a;
  Shardplane__V1__Collective col;
  char *msg;
  char *tmpl; /* NULL: no age */
  uint64_t since_ms;
  uint32_t *culprits, *victims;
} open_alert;

struct sp_coord_alerts {
  uint64_t n; /* raised in all */
  Shardplane__V1__Alert recent[SP_COORD_ALERTS_RECENT];
  char *recent_msg[SP_COORD_ALERTS_RECENT];
  uint32_t *recent_ranks[SP_COORD_ALERTS_RECENT]; /* culprits, victims */
  Shardplane__V1__Collective recent_col[SP_COORD_ALERTS_RECENT];
  size_t recent_next;
  open_alert open[SP_COORD_ALERTS_MAX_OPEN];
  size_t n_open;
};

int sp_coord_alerts_init(sp_coord *c) {
  c->alerts = calloc(1, sizeof *c->alerts);
  return c->alerts != NULL ? 0 : SP_ENOMEM;
}

static void free_open(open_alert *o) {
  free(o->msg);
  free(o->tmpl);
  free(o->culprits);
  free(o->victims);
  memset(o, 0, sizeof *o);
}

void sp_coord_alerts_free(sp_coord *c) {
  sp_coord_alerts *s = c->alerts;
  if (s == NULL) return;
  for (size_t i = 0; i < SP_COORD_ALERTS_RECENT; i++) {
    free(s->recent_msg[i]);
    free(s->recent_ranks[i]);
  }
  for (size_t i = 0; i < s->n_open; i++) free_open(&s->open[i]);
  free(s);
  c->alerts = NULL;
}

/* The Watch streams have it, then the subscribers (the agents). */
static void publish(sp_coord *c, const Shardplane__V1__Alert *a,
                    uint64_t evidence_ms) {
  sp_coord_events_publish_alert(c, a);
  sp_coord_event e = {.kind = SP_COORD_EV_ALERT,
                      .rank = a->rank,
                      .alert = a,
                      .evidence_ms = evidence_ms};
  sp_coord_bus_announce(c, &e);
}

void sp_coord_alerts_raise(sp_coord *c, const sp_coord_alerts_info *in,
                           const char *msg) {
  sp_coord_alerts *s = c->alerts;
  s->n++;
  size_t i = s->recent_next;
  free(s->recent_msg[i]);
  free(s->recent_ranks[i]);
  s->recent_msg[i] = sp_strdup(msg);
  size_t nr = in->n_culprits + in->n_victims;
  s->recent_ranks[i] = nr ? malloc(nr * sizeof(uint32_t)) : NULL;
  Shardplane__V1__Alert *a = &s->recent[i];
  shardplane__v1__alert__init(a);
  a->rank = in->n_culprits ? in->culprits[0] : UINT32_MAX;
  a->message = s->recent_msg[i] ? s->recent_msg[i] : (char *)"";
  a->time_ms = sp_coord_base_now_ms(c);
  a->kind = in->kind;
  if (s->recent_ranks[i] != NULL) {
    if (in->n_culprits) /* no culprit (a stall in the network): NULL */
      memcpy(s->recent_ranks[i], in->culprits,
             in->n_culprits * sizeof(uint32_t));
    if (in->n_victims)
      memcpy(s->recent_ranks[i] + in->n_culprits, in->victims,
             in->n_victims * sizeof(uint32_t));
    a->culprits = s->recent_ranks[i];
    a->n_culprits = in->n_culprits;
    a->victims = s->recent_ranks[i] + in->n_culprits;
    a->n_victims = in->n_victims;
  }
  if (in->collective) {
    s->recent_col[i] = *in->collective;
    a->collective = &s->recent_col[i];
  }
  s->recent_next = (i + 1) % SP_COORD_ALERTS_RECENT;
  sp_coord_persist_alert(c, a->rank, in->kind, msg, a->time_ms);
  sp_coord_event e = {.kind = SP_COORD_EV_ALERT_LOGGED,
                      .rank = a->rank,
                      .text = msg,
                      .culprits = in->culprits,
                      .n_culprits = in->n_culprits};
  sp_coord_bus_announce(c, &e);
  const ProtobufCEnumValue *kn = protobuf_c_enum_descriptor_get_value(
      &shardplane__v1__alert_kind__descriptor, in->kind);
  if (a->rank == UINT32_MAX)
    sp_coord_base_log(c, "alert %s: %s", kn ? kn->name : "?", msg);
  else
    sp_coord_base_log(c, "alert %s: rank %u: %s", kn ? kn->name : "?", a->rank,
                      msg);
  publish(c, a, in->evidence_ms);
}

void sp_coord_alerts_raisef(sp_coord *c, uint32_t rank, const char *fmt, ...) {
  char msg[SP_DIAG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  bool one = rank < c->plan->world_size;
  sp_coord_alerts_info in = {
      .kind = one ? SHARDPLANE__V1__ALERT_KIND__ILLEGAL_TRANSITION
                  : SHARDPLANE__V1__ALERT_KIND__ALERT_KIND_UNKNOWN,
      .culprits = one ? &rank : NULL,
      .n_culprits = one ? 1 : 0};
  sp_coord_alerts_raise(c, &in, msg);
}

void sp_coord_alerts_open(sp_coord *c, const sp_coord_alerts_info *in,
                          const char *msg) {
  sp_coord_alerts *s = c->alerts;
  size_t nc = in->n_culprits, nv = in->n_victims;
  const char *tmpl = in->tmpl;
  sp_coord_alerts_raise(c, in, msg);
  if (s->n_open == SP_COORD_ALERTS_MAX_OPEN) {
    free_open(&s->open[0]);
    memmove(&s->open[0], &s->open[1],
            (SP_COORD_ALERTS_MAX_OPEN - 1) * sizeof s->open[0]);
    memset(&s->open[SP_COORD_ALERTS_MAX_OPEN - 1], 0, sizeof s->open[0]);
    s->n_open--;
  }
  open_alert *o = &s->open[s->n_open];
  shardplane__v1__alert__init(&o->a);
  o->msg = sp_strdup(msg);
  o->tmpl = tmpl ? sp_strdup(tmpl) : NULL;
  o->since_ms = in->since_ms;
  o->culprits = nc ? malloc(nc * sizeof *in->culprits) : NULL;
  o->victims = nv ? malloc(nv * sizeof *in->victims) : NULL;
  if ((nc && o->culprits == NULL) || (nv && o->victims == NULL) ||
      o->msg == NULL || (tmpl && o->tmpl == NULL)) {
    free_open(o);
    return;
  }
  s->n_open++;
  if (nc) memcpy(o->culprits, in->culprits, nc * sizeof *in->culprits);
  if (nv) memcpy(o->victims, in->victims, nv * sizeof *in->victims);
  o->a.kind = in->kind;
  o->a.rank = nc ? in->culprits[0] : UINT32_MAX;
  o->a.message = o->msg;
  o->a.time_ms = sp_coord_base_now_ms(c);
  o->a.culprits = o->culprits;
  o->a.n_culprits = nc;
  o->a.victims = o->victims;
  o->a.n_victims = nv;
  if (in->collective) {
    o->col = *in->collective;
    o->a.collective = &o->col;
  }
}

void sp_coord_alerts_close(sp_coord *c, Shardplane__V1__AlertKind kind,
                           bool any_rank, uint32_t rank) {
  sp_coord_alerts *s = c->alerts;
  size_t j = 0;
  for (size_t i = 0; i < s->n_open; i++) {
    open_alert *o = &s->open[i];
    if (o->a.kind == kind && (any_rank || o->a.rank == rank)) {
      free_open(o);
      continue;
    }
    if (j != i) {
      s->open[j] = *o;
      if (s->open[j].a.collective) s->open[j].a.collective = &s->open[j].col;
      memset(o, 0, sizeof *o);
    }
    j++;
  }
  s->n_open = j;
}

int sp_coord_alerts_new_incarnation(sp_coord *c, void *user,
                                    const sp_coord_event *e) {
  (void)user;
  (void)e;
  sp_coord_alerts *s = c->alerts;
  for (size_t i = 0; i < s->n_open; i++) free_open(&s->open[i]);
  s->n_open = 0;
  return 0;
}

void sp_coord_alerts_render_age(const char *tmpl, double secs, char *out,
                                size_t cap) {
  const char *at = strstr(tmpl, SP_COORD_ALERTS_AGE);
  if (at == NULL) {
    snprintf(out, cap, "%s", tmpl);
    return;
  }
  snprintf(out, cap, "%.*s%.0f%s", (int)(at - tmpl), tmpl, secs, at + 1);
}

/* The open alerts' texts as of now (or as of the job's end: a rank that
 * exited waits no longer). */
static void refresh_ages(sp_coord_alerts *s, uint64_t now) {
  for (size_t i = 0; i < s->n_open; i++) {
    open_alert *o = &s->open[i];
    if (o->tmpl == NULL) continue;
    char msg[SP_DIAG_MAX];
    sp_coord_alerts_render_age(
        o->tmpl, now > o->since_ms ? (double)(now - o->since_ms) / 1e3 : 0, msg,
        sizeof msg);
    if (strcmp(msg, o->msg) == 0) continue;
    char *m = sp_strdup(msg);
    if (m == NULL) continue;
    free(o->msg);
    o->msg = m;
    o->a.message = m;
  }
}

size_t sp_coord_alerts_list_open(sp_coord *c, uint64_t as_of_ms,
                                 Shardplane__V1__Alert **out, size_t cap) {
  sp_coord_alerts *s = c->alerts;
  refresh_ages(s, as_of_ms);
  size_t n = 0;
  for (size_t i = 0; i < s->n_open && n < cap; i++) out[n++] = &s->open[i].a;
  return n;
}

uint64_t sp_coord_alerts_total(const sp_coord *c) { return c->alerts->n; }

size_t sp_coord_alerts_recent(sp_coord *c, Shardplane__V1__Alert **out,
                              size_t cap) {
  sp_coord_alerts *s = c->alerts;
  size_t n =
      s->n < SP_COORD_ALERTS_RECENT ? (size_t)s->n : SP_COORD_ALERTS_RECENT;
  if (n > cap) n = cap;
  for (size_t i = 0; i < n; i++)
    out[i] = &s->recent[(s->recent_next + SP_COORD_ALERTS_RECENT - n + i) %
                        SP_COORD_ALERTS_RECENT];
  return n;
}

int sp_coord_alerts_restore(sp_coord *c, uint32_t rank, int kind,
                            const char *msg, size_t len, uint64_t time_ms) {
  sp_coord_alerts *s = c->alerts;
  if (len > SP_DIAG_MAX) return SP_EFORMAT;
  size_t i = s->recent_next;
  free(s->recent_msg[i]);
  s->recent_msg[i] = sp_strdup(msg);
  shardplane__v1__alert__init(&s->recent[i]);
  s->recent[i].rank = rank;
  s->recent[i].message = s->recent_msg[i] ? s->recent_msg[i] : (char *)"";
  s->recent[i].time_ms = time_ms;
  /* a kind this build does not know reads as unknown */
  s->recent[i].kind = protobuf_c_enum_descriptor_get_value(
                          &shardplane__v1__alert_kind__descriptor, kind)
                          ? (Shardplane__V1__AlertKind)kind
                          : SHARDPLANE__V1__ALERT_KIND__ALERT_KIND_UNKNOWN;
  s->recent_next = (i + 1) % SP_COORD_ALERTS_RECENT;
  return 0;
}

void sp_coord_alerts_restored(sp_coord *c, uint64_t total) {
  c->alerts->n = total;
}
