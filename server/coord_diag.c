/* What the detectors share: the record of what each rank did, kept from
 * the ranks' events, the communicators' membership, the words of the
 * verdicts and the detectors' period. Per rank a few fingerprints and a
 * window of step times (well under a kilobyte). */
#include "coord_diag.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/dtype.h"
#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_ranks.h"

struct sp_coord_diag {
  uv_timer_t timer;
  bool timer_started;
  uint64_t last_tick_ms;
  uint64_t forgiven_ms; /* the coordinator's own pauses, in total */
  sp_coord_diag_topo topo;
  sp_coord_diag_rank *r;
  sp_coord_diag_comm *comms; /* every rank's, n_kinds a rank */
  void (*closed)(void *);
};

/* ---- step timing ---- */

float sp_coord_diag_median(const float *v, size_t n) {
  float tmp[SP_DIAG_STEP_WINDOW];
  if (n == 0) return 0;
  memcpy(tmp, v, n * sizeof *v);
  for (size_t i = 1; i < n; i++) /* n is tiny */
    for (size_t j = i; j > 0 && tmp[j - 1] > tmp[j]; j--) {
      float x = tmp[j];
      tmp[j] = tmp[j - 1];
      tmp[j - 1] = x;
    }
  return n % 2 ? tmp[n / 2] : (tmp[n / 2 - 1] + tmp[n / 2]) / 2;
}

float sp_coord_diag_pct(const float *v, size_t n, double p) {
  float tmp[SP_DIAG_STEP_WINDOW];
  if (n == 0) return 0;
  memcpy(tmp, v, n * sizeof *v);
  for (size_t i = 1; i < n; i++)
    for (size_t j = i; j > 0 && tmp[j - 1] > tmp[j]; j--) {
      float x = tmp[j];
      tmp[j] = tmp[j - 1];
      tmp[j - 1] = x;
    }
  size_t i = (size_t)ceil(p * (double)n) - 1;
  return tmp[i < n ? i : n - 1];
}

/* Hoare's selection: O(n) on average where sorting was O(n log n). The
 * straggler detector's median of every rank's, each 200 ms over the whole
 * world: for 100,000 medians qsort took 14.9 ms of each tick, this 1.0 ms
 * (best of 7 on a loaded machine). */
float sp_coord_diag_select(float *v, size_t n, size_t k) {
  size_t lo = 0, hi = n - 1;
  while (lo < hi) {
    float pivot = v[lo + (hi - lo) / 2];
    size_t i = lo, j = hi;
    while (i <= j) {
      while (v[i] < pivot) i++;
      while (v[j] > pivot) j--;
      if (i <= j) {
        float x = v[i];
        v[i] = v[j];
        v[j] = x;
        i++;
        if (j == 0) break;
        j--;
      }
    }
    if (k <= j)
      hi = j;
    else if (k >= i)
      lo = i;
    else
      break; /* between the halves: equal to the pivot */
  }
  return v[k];
}

static void close_step(sp_coord_diag_rank *k, uint64_t t_us) {
  if (k->step_start_us == 0 || t_us <= k->step_start_us) return;
  if (k->n_closed < UINT8_MAX) k->n_closed++;
  float len = (float)(t_us - k->step_start_us) / 1000.0f;
  float own = len - (float)k->wait_us / 1000.0f;
  k->step_ms[k->next] = len;
  k->busy_ms[k->next] = own > 0 ? own : 0;
  k->next = (uint8_t)((k->next + 1) % SP_DIAG_STEP_WINDOW);
  if (k->n_steps < SP_DIAG_STEP_WINDOW) k->n_steps++;
  k->busy_med = sp_coord_diag_median(k->busy_ms, k->n_steps);
  k->busy_lo = sp_coord_diag_pct(k->busy_ms, k->n_steps, 0.25);
}

/* A step begins with the root's FORWARD_BACKWARD of a new step number. */
static bool time_transition(sp_coord_diag_rank *k,
                            const Shardplane__V1__Transition *t) {
  uint64_t us = t->time_us;
  if (us == 0) return false; /* a worker without timestamps */
  if (k->last_t_us != 0 && us > k->last_t_us) {
    float gap = (float)(us - k->last_t_us) / 1000.0f;
    if (gap > k->gap_cur_ms) k->gap_cur_ms = gap;
  }
  k->last_t_us = us;
  if (t->machine == SHARDPLANE__V1__MACHINE__MACHINE_ROOT &&
      t->state == SP_ROOT_FORWARD_BACKWARD &&
      (t->step != k->cur_step || k->step_start_us == 0)) {
    if (k->step_start_us != 0) { /* a step closes */
      float decayed = 0.9f * k->gap_max_ms;
      k->gap_max_ms = k->gap_cur_ms > decayed ? k->gap_cur_ms : decayed;
    }
    k->gap_cur_ms = 0;
    close_step(k, us);
    k->step_start_us = us;
    k->cur_step = t->step;
    k->wait_us = 0;
    return true;
  }
  return false;
}

/* A completion's wait belongs to the step it ended in. A message carries
 * transitions and collectives apart, so one that ended before the
 * current step began (its step is closed) is taken off that step: the
 * steps are back to back, each ending where the next began, so walking
 * back from the current step's start by their lengths finds it. A message
 * that holds several steps has waits of each: taken all off the last
 * closed one, they left that one at 0 and the others whole. A wait older
 * than the window belongs to none of its steps. */
static void time_wait(sp_coord_diag_rank *k,
                      const Shardplane__V1__Collective *q) {
  if (q->waited_us == 0) return;
  if (k->step_start_us == 0 || q->time_us >= k->step_start_us) {
    k->wait_us += q->waited_us;
    return;
  }
  double end_us = (double)k->step_start_us;
  for (size_t i = 1; i <= k->n_steps; i++) {
    size_t s = (k->next + SP_DIAG_STEP_WINDOW - i) % SP_DIAG_STEP_WINDOW;
    double start_us = end_us - (double)k->step_ms[s] * 1000.0;
    if ((double)q->time_us >= start_us) {
      float own = k->busy_ms[s] - (float)q->waited_us / 1000.0f;
      k->busy_ms[s] = own > 0 ? own : 0;
      k->busy_med = sp_coord_diag_median(k->busy_ms, k->n_steps);
      k->busy_lo = sp_coord_diag_pct(k->busy_ms, k->n_steps, 0.25);
      return;
    }
    end_us = start_us;
  }
}

/* ---- names ---- */

void sp_coord_diag_say(char *out, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out, cap, fmt, ap);
  va_end(ap);
}

const char *sp_coord_diag_op_name(uint8_t op) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
      &shardplane__v1__collective_op__descriptor, op);
  return v ? v->name : "?";
}

static const char *comm_kind_name(int kind) {
  return kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD     ? "shard group"
         : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA ? "replica group"
                                                           : "world";
}

void sp_coord_diag_comm_label(int kind, uint32_t index, char *out, size_t cap) {
  if (kind == SHARDPLANE__V1__COMM_KIND__COMM_WORLD)
    snprintf(out, cap, "world");
  else
    snprintf(out, cap, "%s %u", comm_kind_name(kind), index);
}

const char *sp_coord_diag_unit_name(const sp_coord *c, uint32_t unit) {
  if (unit >= c->plan->n_units) return "?";
  const char *n = sp_plan_unit_fqn(c->plan, unit);
  return n && n[0] ? n : "root";
}

void sp_coord_diag_fmt_ranks(const uint32_t *v, size_t n, char *out,
                             size_t cap) {
  size_t used = 0;
  int w = snprintf(out, cap, "%s ", n == 1 ? "rank" : "ranks");
  if (w < 0 || (size_t)w >= cap) return;
  used = (size_t)w;
  for (size_t i = 0; i < n && used < cap;) {
    size_t j = i;
    while (j + 1 < n && v[j + 1] == v[j] + 1) j++;
    if (j > i + 1 || j == i + 1)
      w = snprintf(out + used, cap - used, "%s%u%s%u", i ? ", " : "", v[i],
                   j == i + 1 ? ", " : "-", v[j]);
    else
      w = snprintf(out + used, cap - used, "%s%u", i ? ", " : "", v[i]);
    if (w < 0) break;
    used += (size_t)w;
    i = j + 1;
  }
  if (used >= cap) out[cap - 1] = '\0';
}

void sp_coord_diag_fp_words(const sp_coord *c, const sp_coord_diag_fprint *f,
                            char *out, size_t cap) {
  snprintf(out, cap, "%s of unit %u (%s), %s x %" PRIu64,
           sp_coord_diag_op_name(f->op), f->unit,
           sp_coord_diag_unit_name(c, f->unit),
           sp_dtype_name((sp_dtype)f->dtype), f->count);
}

void sp_coord_diag_last_event(const sp_coord *c, uint32_t rank, char *out,
                              size_t cap) {
  const sp_coord_diag_rank *k = &c->diag->r[rank];
  if (!k->active) {
    snprintf(out, cap, "none since it attached");
    return;
  }
  if (k->last_machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE)
    snprintf(out, cap, "%s of unit %u, step %" PRIu64,
             sp_state_name(SP_MACHINE_HANDLE, k->last_state), k->last_unit,
             k->last_step);
  else
    snprintf(out, cap, "%s, step %" PRIu64,
             sp_state_name(SP_MACHINE_ROOT, k->last_state), k->last_step);
}

void sp_coord_diag_collective_msg(Shardplane__V1__Collective *m,
                                  const sp_coord_diag_fprint *f, int kind,
                                  uint32_t index) {
  shardplane__v1__collective__init(m);
  m->seq = f->seq;
  m->op = (Shardplane__V1__CollectiveOp)f->op;
  m->unit = f->unit;
  m->dtype = (Shardplane__V1__DType)f->dtype;
  m->count = f->count;
  m->comm = (Shardplane__V1__CommKind)kind;
  m->comm_index = index;
}

/* ---- setup ---- */

/* What one incarnation of the job builds up (the ranks' records),
 * allocated for the world; the timer is not touched. */
static int diag_alloc(sp_coord *c, sp_coord_diag *d) {
  sp_coord_diag_topo *t = &d->topo;
  t->world = c->plan->world_size;
  d->r = calloc(t->world, sizeof *d->r);
  if (d->r == NULL) return SP_ENOMEM;
  bool hybrid =
      c->plan->strategy == SP_HYBRID_SHARD && c->plan->shard_world > 0;
  if (hybrid) {
    t->shard_world = c->plan->shard_world;
    t->n_shard = t->world / t->shard_world;
    t->n_replica = t->shard_world;
  }
  t->n_kinds = hybrid ? SP_DIAG_KINDS : 1;
  d->comms = calloc((size_t)t->world * (size_t)t->n_kinds, sizeof *d->comms);
  if (d->comms == NULL) return SP_ENOMEM;
  for (uint32_t r = 0; r < t->world; r++)
    d->r[r].comm = &d->comms[(size_t)r * (size_t)t->n_kinds];
  return 0;
}

int sp_coord_diag_init(sp_coord *c) {
  sp_coord_diag *d = calloc(1, sizeof *d);
  if (d == NULL) return SP_ENOMEM;
  c->diag = d;
  return diag_alloc(c, d);
}

void sp_coord_diag_free(sp_coord *c) {
  sp_coord_diag *d = c->diag;
  if (d == NULL) return;
  free(d->comms);
  free(d->r);
  free(d);
  c->diag = NULL;
}

int sp_coord_diag_new_incarnation(sp_coord *c, void *user,
                                  const sp_coord_event *e) {
  (void)user;
  (void)e;
  sp_coord_diag *d = c->diag;
  free(d->comms);
  free(d->r);
  /* everything after the timer fields starts afresh: the next
   * incarnation's collectives count from 0 again (the timer handle is the
   * loop's and stays where it is) */
  uint64_t forgiven = d->forgiven_ms;
  void (*closed)(void *) = d->closed;
  memset(&d->topo, 0, sizeof *d - offsetof(sp_coord_diag, topo));
  d->forgiven_ms = forgiven;
  d->closed = closed;
  return diag_alloc(c, d);
}

const sp_coord_diag_topo *sp_coord_diag_topology(const sp_coord *c) {
  return &c->diag->topo;
}

const sp_coord_diag_rank *sp_coord_diag_ranks(const sp_coord *c) {
  return c->diag->r;
}

uint64_t sp_coord_diag_forgiven_ms(const sp_coord *c) {
  return c->diag->forgiven_ms;
}

bool sp_coord_diag_counts(const sp_coord *c, uint32_t rank,
                          const Shardplane__V1__Collective *q) {
  const sp_coord_diag_topo *t = &c->diag->topo;
  int kind = (int)q->comm;
  uint32_t index = q->comm_index;
  if (kind < 0 || kind >= t->n_kinds || q->seq == 0) return false;
  switch (kind) {
    case SHARDPLANE__V1__COMM_KIND__COMM_SHARD:
      return index < t->n_shard && rank / t->shard_world == index;
    case SHARDPLANE__V1__COMM_KIND__COMM_REPLICA:
      return index < t->n_replica && rank % t->shard_world == index;
    default: return index == 0;
  }
}

size_t sp_coord_diag_others(const sp_coord *c, const uint32_t *cul, size_t nc,
                            uint32_t *out) {
  size_t n = 0;
  for (uint32_t r = 0; r < c->diag->topo.world; r++) {
    bool is = false;
    for (size_t i = 0; i < nc; i++) is |= cul[i] == r;
    if (!is && sp_coord_ranks_attached(c, r)) out[n++] = r;
  }
  return n;
}

void sp_coord_diag_open_alert(sp_coord *c, Shardplane__V1__AlertKind kind,
                              uint32_t rank, const char *msg,
                              uint64_t evidence_ms) {
  uint32_t *v = malloc((size_t)c->diag->topo.world * sizeof *v);
  size_t nv = v ? sp_coord_diag_others(c, &rank, 1, v) : 0;
  sp_coord_alerts_info in = {.kind = kind,
                             .culprits = &rank,
                             .n_culprits = 1,
                             .victims = v,
                             .n_victims = nv,
                             .evidence_ms = evidence_ms};
  sp_coord_alerts_open(c, &in, msg);
  free(v);
}

uint64_t sp_coord_diag_stall_threshold(const sp_coord *c) {
  if (c->cfg.diag.stall_timeout_ms) return c->cfg.diag.stall_timeout_ms;
  const sp_coord_diag *d = c->diag;
  /* the most of the ranks' p99 step times; a window's nearest-rank p99
   * (sp_coord_diag_pct) is its longest step, as long as it holds at most
   * 100, so no window is sorted: at 100,000 ranks the sorts took 30 ms
   * of every call */
  _Static_assert(SP_DIAG_STEP_WINDOW <= 100, "p99 of a window is its max");
  float p99 = 0;
  for (uint32_t r = 0; r < d->topo.world; r++) {
    const sp_coord_diag_rank *k = &d->r[r];
    for (uint8_t i = 0; i < k->n_steps; i++)
      if (k->step_ms[i] > p99) p99 = k->step_ms[i];
  }
  uint64_t adaptive = (uint64_t)(SP_DIAG_STALL_K * p99);
  return adaptive > SP_DIAG_STALL_FLOOR_MS ? adaptive : SP_DIAG_STALL_FLOOR_MS;
}

/* ---- the record, from the ranks' events ---- */

int sp_coord_diag_attached(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  sp_coord_diag *d = c->diag;
  sp_coord_diag_rank *k = &d->r[e->rank];
  sp_coord_diag_comm *comm = k->comm;
  memset(k, 0, sizeof *k);
  memset(comm, 0, (size_t)d->topo.n_kinds * sizeof *comm);
  k->comm = comm;
  k->last_event_ms = sp_coord_base_now_ms(c);
  return 0;
}

int sp_coord_diag_transition(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  const Shardplane__V1__Transition *t = e->transition;
  sp_coord_diag_rank *k = &c->diag->r[e->rank];
  k->active = true;
  k->last_event_ms = sp_coord_base_now_ms(c);
  k->last_machine = (uint8_t)t->machine;
  k->last_state = (uint8_t)t->state;
  k->last_unit = t->unit;
  if (t->step > k->last_step) k->last_step = t->step;
  if (time_transition(k, t)) k->judge_due = true;
  return 0;
}

int sp_coord_diag_collective(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  const Shardplane__V1__Collective *q = e->collective;
  sp_coord_diag_rank *k = &c->diag->r[e->rank];
  k->active = true;
  k->last_event_ms = e->now_ms;
  if (!sp_coord_diag_counts(c, e->rank, q)) return 0;
  sp_coord_diag_comm *m = &k->comm[q->comm];
  sp_coord_diag_fprint f = {.seq = q->seq,
                            .count = q->count,
                            .unit = q->unit,
                            .op = (uint8_t)q->op,
                            .dtype = (uint8_t)q->dtype};
  if (q->completed) {
    if (q->seq > m->done_seq) m->done_seq = q->seq;
    time_wait(k, q);
    return 0;
  }
  if (q->seq > m->issued.seq) {
    m->issued = f;
    m->issued_ms = e->now_ms;
    m->index = q->comm_index;
  }
  m->ring[q->seq % SP_DIAG_RANK_RING] = f;
  return 0;
}

int sp_coord_diag_session_up_done(sp_coord *c, void *user,
                                  const sp_coord_event *e) {
  (void)user;
  sp_coord_diag_rank *k = &c->diag->r[e->rank];
  /* judged before its waits were taken off, a step counted them as the
   * rank's own time: every rank scored above the median it is part of */
  if (k->judge_due) {
    sp_coord_event step = {
        .kind = SP_COORD_EV_STEP, .rank = e->rank, .n_closed = k->n_closed};
    k->judge_due = false;
    k->n_closed = 0;
    sp_coord_bus_announce(c, &step);
  }
  return 0;
}

int sp_coord_diag_rank_info(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  Shardplane__V1__RankInfo *x = e->info;
  const sp_coord_diag_rank *k = &c->diag->r[e->rank];
  x->step_p50_ms = sp_coord_diag_pct(k->step_ms, k->n_steps, 0.50);
  x->step_p90_ms = sp_coord_diag_pct(k->step_ms, k->n_steps, 0.90);
  x->step_p99_ms = sp_coord_diag_pct(k->step_ms, k->n_steps, 0.99);
  return 0;
}

/* ---- the tick ---- */

/* The coordinator's own pause (the tick came late) is nobody's silence:
 * the events that arrived meanwhile wait unread in the sockets. */
static void forgive_pause(sp_coord *c, uint64_t now) {
  sp_coord_diag *d = c->diag;
  uint64_t due = d->last_tick_ms + SP_DIAG_TICK_MS;
  if (d->last_tick_ms != 0 && now > due + SP_DIAG_TICK_MS) {
    uint64_t late = now - due;
    d->forgiven_ms += late;
    for (uint32_t r = 0; r < d->topo.world; r++) {
      sp_coord_diag_rank *k = &d->r[r];
      k->last_event_ms += late;
      if (k->last_event_ms > now) k->last_event_ms = now;
      for (int i = 0; i < d->topo.n_kinds; i++) {
        k->comm[i].issued_ms += late;
        if (k->comm[i].issued_ms > now) k->comm[i].issued_ms = now;
      }
    }
  }
  d->last_tick_ms = now;
}

static void on_tick(uv_timer_t *t) {
  sp_coord *c = t->data;
  uv_update_time(c->loop);
  uint64_t now = sp_coord_base_now_ms(c);
  forgive_pause(c, now);
  sp_coord_event e = {.kind = SP_COORD_EV_TICK, .now_ms = now};
  sp_coord_bus_announce(c, &e);
}

void sp_coord_diag_start(sp_coord *c) {
  sp_coord_diag *d = c->diag;
  if (d->timer_started) return;
  uv_timer_init(c->loop, &d->timer);
  d->timer.data = c;
  d->timer_started = true;
  uv_update_time(c->loop);
  d->last_tick_ms = sp_coord_base_now_ms(c);
  uv_timer_start(&d->timer, on_tick, SP_DIAG_TICK_MS, SP_DIAG_TICK_MS);
}

static void timer_closed(uv_handle_t *h) {
  sp_coord *c = h->data;
  c->diag->closed(c);
}

void sp_coord_diag_shutdown(sp_coord *c, void (*closed)(void *)) {
  sp_coord_diag *d = c->diag;
  if (d == NULL || !d->timer_started) {
    closed(c);
    return;
  }
  d->closed = closed;
  uv_timer_stop(&d->timer);
  uv_close((uv_handle_t *)&d->timer, timer_closed);
}
