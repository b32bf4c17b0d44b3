/* The replica quorum (coord_quorum.h). */
#include "coord_quorum.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "coord_agents.h"
#include "coord_base.h"
#include "coord_desync.h"
#include "coord_events.h"
#include "coord_persist.h"
#include "coord_ranks.h"

typedef struct q_group {
  bool in;
  uint32_t gen;
  uint32_t ready; /* ranks of generation gen that said they are ready */
  uint64_t dropped_ms, rejoined_ms, dropped_step, rejoined_step;
  char why[256];
  int cause; /* how telling why is (SP_COORD_CAUSE_*) */
} q_group;

struct sp_coord_quorum {
  uint32_t groups, size; /* R groups of S ranks */
  uint64_t epoch;
  q_group *g;
  uint8_t *ready; /* per rank: said ready at its group's generation */
};

bool sp_coord_quorum_on(const sp_coord *c) { return c->quorum != NULL; }

/* A key of the coordinator's, written down with the store. */
static void put(sp_coord *c, const char *key, const char *val) {
  uint64_t version;
  size_t klen = strlen(key);
  if (sp_kvstore_set(c->store, key, klen, val, strlen(val), &version) != 0 ||
      sp_coord_persist_key(c, key, klen) != 0)
    sp_coord_base_log(c, "replica quorum: cannot write store key %s", key);
}

static bool get_u64(const sp_coord *c, const char *key, uint64_t *v) {
  const uint8_t *val;
  size_t len;
  uint64_t version;
  if (sp_kvstore_get(c->store, key, strlen(key), &val, &len, &version) != 0)
    return false;
  char *end;
  *v = strtoull((const char *)val, &end, 10);
  return len > 0 && end == (const char *)val + len;
}

/* The epoch as it is now: its groups, then the pointer to it (a rank that
 * reads the pointer finds the list), then the announcement. */
static void publish(sp_coord *c) {
  struct sp_coord_quorum *q = c->quorum;
  char key[48], num[24];
  size_t cap = (size_t)q->groups * 11 + 1;
  char *list = calloc(1, cap);
  if (list == NULL) {
    sp_coord_base_log(c, "replica quorum: out of memory");
    return;
  }
  size_t at = 0;
  for (uint32_t g = 0; g < q->groups; g++)
    if (q->g[g].in)
      at += (size_t)snprintf(list + at, cap - at, "%s%u", at ? "," : "", g);
  snprintf(key, sizeof key, "quorum/e/%" PRIu64, q->epoch);
  put(c, key, list);
  free(list);
  snprintf(num, sizeof num, "%" PRIu64, q->epoch);
  put(c, "quorum/epoch", num);
  sp_coord_ranks_send_quorum(c, q->epoch);
  /* the groups that start again number their collectives from 1, and the
   * replica groups are new: what was compared before no longer lines up */
  if (sp_coord_desync_new_incarnation(c, NULL, NULL) != 0)
    sp_coord_base_log(c, "replica quorum: desync tables: out of memory");
}

static void put_gen(sp_coord *c, uint32_t g) {
  char key[48], num[16];
  snprintf(key, sizeof key, "quorum/gen/%u", g);
  snprintf(num, sizeof num, "%u", c->quorum->g[g].gen);
  put(c, key, num);
}

void sp_coord_quorum_reset(sp_coord *c) {
  struct sp_coord_quorum *q = c->quorum;
  if (q == NULL) return;
  q->epoch = 0;
  for (uint32_t g = 0; g < q->groups; g++) {
    q->g[g].in = true;
    q->g[g].gen = 0;
    q->g[g].ready = 0;
  }
  memset(q->ready, 0, (size_t)q->groups * q->size);
  publish(c);
}

int sp_coord_quorum_init(sp_coord *c) {
  const sp_plan *pl = c->plan;
  if (!c->cfg.groups_continue || pl->strategy != SP_HYBRID_SHARD ||
      pl->shard_world == 0 || pl->world_size / pl->shard_world < 2)
    return 0;
  struct sp_coord_quorum *q = calloc(1, sizeof *q);
  if (q == NULL) return SP_ENOMEM;
  q->size = pl->shard_world;
  q->groups = pl->world_size / pl->shard_world;
  q->g = calloc(q->groups, sizeof *q->g);
  q->ready = calloc(pl->world_size, 1);
  c->quorum = q;
  if (q->g == NULL || q->ready == NULL) return SP_ENOMEM;
  /* a state dir's store holds the quorum of the coordinator before */
  uint64_t e;
  const uint8_t *list;
  size_t len;
  uint64_t version;
  char key[48];
  if (get_u64(c, "quorum/epoch", &e) &&
      (snprintf(key, sizeof key, "quorum/e/%" PRIu64, e),
       sp_kvstore_get(c->store, key, strlen(key), &list, &len, &version) ==
           0)) {
    q->epoch = e;
    for (const char *p = (const char *)list; *p;) {
      char *end;
      unsigned long g = strtoul(p, &end, 10);
      if (end == p) break;
      if (g < q->groups) q->g[g].in = true;
      p = *end == ',' ? end + 1 : end;
    }
    for (uint32_t g = 0; g < q->groups; g++) {
      uint64_t gen = 0;
      snprintf(key, sizeof key, "quorum/gen/%u", g);
      if (get_u64(c, key, &gen)) q->g[g].gen = (uint32_t)gen;
    }
    sp_coord_base_log(c, "replica quorum: epoch %" PRIu64 " read back", e);
    return 0;
  }
  sp_coord_quorum_reset(c);
  return 0;
}

void sp_coord_quorum_free(sp_coord *c) {
  if (c->quorum == NULL) return;
  free(c->quorum->g);
  free(c->quorum->ready);
  free(c->quorum);
  c->quorum = NULL;
}

/* The most steps a rank of a group in the quorum reported. */
static uint64_t live_step(const sp_coord *c) {
  const struct sp_coord_quorum *q = c->quorum;
  uint64_t best = 0;
  for (uint32_t g = 0; g < q->groups; g++)
    for (uint32_t i = 0; q->g[g].in && i < q->size; i++) {
      uint64_t s = sp_coord_ranks_step(c, g * q->size + i);
      if (s > best) best = s;
    }
  return best;
}

bool sp_coord_quorum_settling(const sp_coord *c, uint32_t rank) {
  const struct sp_coord_quorum *q = c->quorum;
  if (q == NULL || rank >= c->plan->world_size) return false;
  const q_group *x = &q->g[rank / q->size];
  return !x->in || (x->rejoined_ms != 0 &&
                    sp_coord_ranks_step(c, rank) <= x->rejoined_step);
}

bool sp_coord_quorum_drop(sp_coord *c, uint32_t rank, const char *why,
                          int cause) {
  struct sp_coord_quorum *q = c->quorum;
  if (q == NULL || c->shutting_down || rank >= c->plan->world_size)
    return false;
  uint32_t g0 = rank / q->size;
  q_group *x0 = &q->g[g0];
  if (!x0->in) { /* dropped already: part of that drop */
    if (cause > x0->cause && sp_clock_unix_ms() - x0->dropped_ms < 5000) {
      snprintf(x0->why, sizeof x0->why, "%s", why);
      x0->cause = cause;
    }
    return true;
  }
  /* the groups that go with it: every one on a host whose agent restarts
   * its workers (all of a host's, so a group sharing one goes too) */
  uint32_t lo = g0 * q->size, hi = lo + q->size - 1;
  for (;;) {
    uint32_t nlo = lo, nhi = hi;
    sp_coord_agents_hosts_of(c, lo, hi, &nlo, &nhi);
    nlo = nlo / q->size * q->size;
    nhi = nhi / q->size * q->size + q->size - 1;
    if (nlo == lo && nhi == hi) break;
    lo = nlo;
    hi = nhi;
  }
  uint32_t left = 0;
  for (uint32_t g = 0; g < q->groups; g++)
    if (q->g[g].in && (g < lo / q->size || g > hi / q->size)) left++;
  if (left == 0) {
    sp_coord_base_log(c,
                      "replica quorum: rank %u's fault (%s) leaves no replica "
                      "group to continue",
                      rank, why);
    return false;
  }
  uint64_t now = sp_clock_unix_ms(), step = live_step(c);
  char text[512];
  for (uint32_t g = lo / q->size; g <= hi / q->size; g++) {
    if (!q->g[g].in) continue;
    q->g[g].in = false;
    q->g[g].gen++;
    q->g[g].ready = 0;
    memset(q->ready + (size_t)g * q->size, 0, q->size);
    q->g[g].dropped_ms = now;
    q->g[g].dropped_step = step;
    q->g[g].rejoined_ms = 0;
    q->g[g].cause = g == g0 ? cause : SP_COORD_CAUSE_SEEN;
    if (g == g0)
      snprintf(q->g[g].why, sizeof q->g[g].why, "%s", why);
    else
      snprintf(q->g[g].why, sizeof q->g[g].why,
               "it shares a host with group %u (%s)", g0, why);
    put_gen(c, g);
    snprintf(text, sizeof text,
             "replica group %u (ranks %u-%u) dropped at step %" PRIu64
             ": %s; %u %s on",
             g, g * q->size, g * q->size + q->size - 1, step, q->g[g].why, left,
             left == 1 ? "group trains" : "groups train");
    sp_coord_base_log(c, "%s", text);
    sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__GROUP_DROPPED,
                            g * q->size, text, NULL);
  }
  q->epoch++;
  publish(c);
  snprintf(text, sizeof text, "its replica group was dropped (%s); rejoining",
           why);
  sp_coord_agents_restart(c, lo, hi, text);
  return true;
}

static void admit(sp_coord *c, uint32_t g) {
  struct sp_coord_quorum *q = c->quorum;
  q_group *x = &q->g[g];
  x->in = true;
  x->rejoined_ms = sp_clock_unix_ms();
  x->rejoined_step = live_step(c);
  q->epoch++;
  char text[512];
  snprintf(text, sizeof text,
           "replica group %u (ranks %u-%u) rejoins at step %" PRIu64
           " after %.1f s out (%" PRIu64
           " steps trained without it): it receives the live state",
           g, g * q->size, g * q->size + q->size - 1, x->rejoined_step,
           (double)(x->rejoined_ms - x->dropped_ms) / 1e3,
           x->rejoined_step - x->dropped_step);
  sp_coord_base_log(c, "%s", text);
  sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__GROUP_REJOINED,
                          g * q->size, text, NULL);
  publish(c);
}

/* "<a>/<b>/<c>" of up to n numbers after prefix; false when malformed. */
static bool parse_nums(const char *key, size_t klen, const char *prefix,
                       uint64_t *v, int n) {
  size_t pl = strlen(prefix);
  if (klen <= pl || memcmp(key, prefix, pl) != 0 || klen - pl > 64)
    return false;
  char buf[72];
  memcpy(buf, key + pl, klen - pl);
  buf[klen - pl] = '\0';
  const char *p = buf;
  for (int i = 0; i < n; i++) {
    char *end;
    if (*p < '0' || *p > '9') return false;
    v[i] = strtoull(p, &end, 10);
    if (i + 1 < n ? *end != '/' : *end != '\0') return false;
    p = end + 1;
  }
  return true;
}

void sp_coord_quorum_key(sp_coord *c, const char *key, size_t klen) {
  struct sp_coord_quorum *q = c->quorum;
  if (q == NULL) return;
  uint64_t v[3];
  if (parse_nums(key, klen, "comm/quorum/ready/", v, 3)) {
    uint64_t g = v[0], gen = v[1], rank = v[2];
    if (g >= q->groups || rank / q->size != g || q->g[g].in ||
        gen != q->g[g].gen || q->ready[rank])
      return;
    q->ready[rank] = 1;
    if (++q->g[g].ready == q->size) admit(c, (uint32_t)g);
  } else if (parse_nums(key, klen, "comm/quorum/reform/", v, 1)) {
    if (v[0] != q->epoch) return; /* a newer one exists already */
    sp_coord_base_log(c,
                      "replica quorum: a replica group of epoch %" PRIu64
                      " broke with no rank lost; forming the same groups "
                      "again",
                      q->epoch);
    q->epoch++;
    publish(c);
  }
}

bool sp_coord_quorum_finished(const sp_coord *c) {
  const struct sp_coord_quorum *q = c->quorum;
  if (q == NULL) return false;
  for (uint32_t g = 0; g < q->groups; g++)
    for (uint32_t i = 0; i < q->size; i++) {
      int st = sp_coord_ranks_status(c, g * q->size + i);
      if (q->g[g].in ? st != SHARDPLANE__V1__RANK_STATUS__DETACHED
                     : st == SHARDPLANE__V1__RANK_STATUS__ATTACHED)
        return false;
    }
  return true;
}

/* "HH:MM:SS" UTC of a unix time in ms. */
static void hms(uint64_t ms, char *out, size_t cap) {
  time_t t = (time_t)(ms / 1000);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(out, cap, "%H:%M:%S", &tm);
}

Shardplane__V1__ReplicaQuorum *sp_coord_quorum_report(const sp_coord *c) {
  const struct sp_coord_quorum *q = c->quorum;
  if (q == NULL) return NULL;
  size_t n = 0;
  for (uint32_t g = 0; g < q->groups; g++) n += q->g[g].gen > 0;
  enum { SUMMARY = 512 };
  struct block {
    Shardplane__V1__ReplicaQuorum q;
  } *b = calloc(
      1, sizeof *b + n * (sizeof(void *) +
                          sizeof(Shardplane__V1__ReplicaGroup) + SUMMARY));
  if (b == NULL) return NULL;
  Shardplane__V1__ReplicaQuorum *r = &b->q;
  shardplane__v1__replica_quorum__init(r);
  Shardplane__V1__ReplicaGroup **ptrs = (void *)(b + 1);
  Shardplane__V1__ReplicaGroup *msgs = (void *)(ptrs + n);
  char *text = (char *)(msgs + n);
  r->epoch = q->epoch;
  r->groups = q->groups;
  r->dropped = ptrs;
  for (uint32_t g = 0; g < q->groups; g++) {
    const q_group *x = &q->g[g];
    r->in_quorum += x->in;
    if (x->gen == 0) continue;
    Shardplane__V1__ReplicaGroup *m = &msgs[r->n_dropped];
    char *s = text + r->n_dropped * SUMMARY;
    ptrs[r->n_dropped++] = m;
    shardplane__v1__replica_group__init(m);
    m->group = g;
    m->first_rank = g * q->size;
    m->ranks = q->size;
    m->in_quorum = x->in;
    m->drops = x->gen;
    m->dropped_unix_ms = x->dropped_ms;
    m->dropped_at_step = x->dropped_step;
    m->why = (char *)x->why;
    m->rejoined_unix_ms = x->rejoined_ms;
    m->rejoined_at_step = x->rejoined_step;
    m->summary = s;
    char at[16];
    hms(x->dropped_ms, at, sizeof at);
    int k = snprintf(s, SUMMARY,
                     "replica group %u (ranks %u-%u): dropped at %s UTC at "
                     "step %" PRIu64 ": %s; ",
                     g, m->first_rank, m->first_rank + q->size - 1, at,
                     x->dropped_step, x->why);
    if (k < 0 || k >= SUMMARY) continue;
    if (x->rejoined_ms)
      snprintf(s + k, SUMMARY - (size_t)k,
               "back %.1f s later at step %" PRIu64
               " with the live state (the others trained %" PRIu64
               " steps without it)",
               (double)(x->rejoined_ms - x->dropped_ms) / 1e3, x->rejoined_step,
               x->rejoined_step - x->dropped_step);
    else
      snprintf(s + k, SUMMARY - (size_t)k, "out for %.1f s so far",
               (double)(sp_clock_unix_ms() - x->dropped_ms) / 1e3);
    if (x->gen > 1) {
      size_t l = strlen(s);
      snprintf(s + l, SUMMARY - l, " (dropped %u times)", x->gen);
    }
  }
  return r;
}
