/* The detectors: desync from the per-communicator fingerprints, stall from
 * the ranks' silence while they heartbeat, stragglers from the workers'
 * own timestamps, victims from who failed first, and the job's state.
 * Per rank the coordinator keeps a few fingerprints and a window of step
 * times (well under a kilobyte); per communicator a ring of the first
 * fingerprint seen at each recent seq. */
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

#define N_KINDS 3
/* Fingerprints a communicator remembers: more than a rank can be ahead of
 * its slowest peer (FSDP's in-flight limit is a handful). */
#define COMM_SLOTS 64u
/* Issued collectives a rank remembers per communicator kind, to say which
 * side of a desync it is on. */
#define RANK_RING 4u
/* How long a tied desync waits for a member to break the tie (well within
 * the second the verdict is due in). */
#define DESYNC_TIE_MS 400u

static void judge_straggler(sp_coord *c, uint32_t r);

typedef struct fprint {
  uint64_t seq, count;
  uint32_t unit;
  uint8_t op, dtype;
} fprint;

typedef struct comm_slot {
  fprint f;
  uint32_t first_rank;
} comm_slot;

typedef struct comm_table {
  comm_slot *slots; /* COMM_SLOTS, allocated on first use */
  bool desynced;    /* alerted once: the rest follows from it */
  /* A mismatch seen while both sides had as many ranks (rank 1 says 259
   * elements, rank 2 says 260, the others have not issued it yet): which
   * one is the odd one out is not known yet. The next member's
   * fingerprint decides, or, after DESYNC_TIE_MS, the tie rule. */
  bool pending;
  uint64_t pending_ms;
  uint32_t pending_rank;
  fprint pending_f;
} comm_table;

/* What a rank did on one communicator kind. */
typedef struct rank_comm {
  fprint issued;      /* the last issued */
  uint64_t issued_ms; /* coordinator clock */
  uint64_t done_seq;  /* the last completed */
  uint32_t index;     /* comm_index */
  fprint ring[RANK_RING];
} rank_comm;

/* One per rank of the world, allocated at start: the flags share words
 * with the fields of 4 bytes (240 bytes a rank with them apart, 224). */
typedef struct diag_rank {
  uint64_t last_event_ms;
  bool active; /* sent any event since it attached */
  /* its last transition, for "rank 3's last event: ..." */
  uint8_t last_machine, last_state;
  bool has_loss; /* loss below holds one */
  uint32_t last_unit;
  uint64_t last_step;
  /* the kinds the strategy has (sp_coord_diag.n_kinds): the world's,
   * and HYBRID_SHARD's shard and replica groups'; a job of another
   * strategy keeps only the first, a third of the state per rank */
  rank_comm *comm;
  /* step timing from the worker's clock: a step's own time is its length
   * less the time its training thread was blocked waiting for collectives
   * (the completions' waited_us), that is for its peers */
  uint64_t step_start_us, cur_step, wait_us;
  /* the longest silence between its transitions (its clock): in the
   * step under way, and the most of its recent steps (decaying by a tenth
   * a step, so that a slow start is forgotten); what "still moving" is
   * judged against */
  uint64_t last_t_us;
  float gap_cur_ms, gap_max_ms;
  float step_ms[SP_DIAG_STEP_WINDOW], busy_ms[SP_DIAG_STEP_WINDOW];
  uint8_t n_steps, next;
  bool straggling;
  bool victim; /* of victim_of, below */
  float score, busy_med;
  float busy_lo; /* its 25th percentile: how fast its faster steps are */
  /* the rank's step when it first crossed the straggler bar (0: it has
   * not): one slow window is not a straggler, a slow stretch is */
  uint64_t over_since;
  uint32_t victim_of;
  /* a step closed in the message being read: judged once its waits,
   * which the message carries after its transitions, are taken off */
  bool judge_due;
  double loss;
} diag_rank;

struct sp_coord_diag {
  uv_timer_t timer;
  bool timer_started;
  uint64_t last_tick_ms;
  uint64_t forgiven_ms; /* the coordinator's own pauses, in total */
  diag_rank *r;
  rank_comm *comms; /* every rank's, n_kinds a rank */
  int n_kinds;
  uint32_t world, shard_world, n_shard, n_replica;
  comm_table world_t, *shard_t, *replica_t;
  Shardplane__V1__JobState state;
  bool ever_running;
  char *verdict; /* FAILED */
  uint64_t end_step;
  bool has_culprit;
  uint32_t culprit;
  char *culprit_msg; /* the verdict that named it */
  bool stall_open;
  uint64_t total_steps;
  /* progress: the slowest rank's step at two moments */
  uint64_t rate_t0_ms, rate_step0;
  double steps_per_s;
  uint64_t last_min_step;
  uint64_t end_ms;      /* when the job FAILED or COMPLETED: ages stop */
  /* the median of the ranks' own step times, from the last tick (0: not
   * yet known), that each rank's step close is judged against */
  float job_med;
  char last_event_buf[160];
  void (*closed)(void *);
};

/* ---- straggler timing ---- */

static float median_of(const float *v, size_t n) {
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

static float pct_of(const float *v, size_t n, double p) {
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

static void close_step(diag_rank *k, uint64_t t_us) {
  if (k->step_start_us == 0 || t_us <= k->step_start_us) return;
  float len = (float)(t_us - k->step_start_us) / 1000.0f;
  float own = len - (float)k->wait_us / 1000.0f;
  k->step_ms[k->next] = len;
  k->busy_ms[k->next] = own > 0 ? own : 0;
  k->next = (uint8_t)((k->next + 1) % SP_DIAG_STEP_WINDOW);
  if (k->n_steps < SP_DIAG_STEP_WINDOW) k->n_steps++;
  k->busy_med = median_of(k->busy_ms, k->n_steps);
  k->busy_lo = pct_of(k->busy_ms, k->n_steps, 0.25);
}

/* A step begins with the root's FORWARD_BACKWARD of a new step number. */
static bool time_transition(diag_rank *k, const Shardplane__V1__Transition *t) {
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
static void time_wait(diag_rank *k, const Shardplane__V1__Collective *q) {
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
      k->busy_med = median_of(k->busy_ms, k->n_steps);
      k->busy_lo = pct_of(k->busy_ms, k->n_steps, 0.25);
      return;
    }
    end_us = start_us;
  }
}

/* ---- names ---- */

/* Verdicts are cut at SP_DIAG_MAX (what the alert log keeps). */
static void say(char *out, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void say(char *out, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out, cap, fmt, ap);
  va_end(ap);
}

static const char *op_name(uint8_t op) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
      &shardplane__v1__collective_op__descriptor, op);
  return v ? v->name : "?";
}

static const char *comm_kind_name(int kind) {
  return kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD     ? "shard group"
         : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA ? "replica group"
                                                           : "world";
}

static void comm_label(int kind, uint32_t index, char *out, size_t cap) {
  if (kind == SHARDPLANE__V1__COMM_KIND__COMM_WORLD)
    snprintf(out, cap, "world");
  else
    snprintf(out, cap, "%s %u", comm_kind_name(kind), index);
}

static const char *unit_name(const sp_coord *c, uint32_t unit) {
  if (unit >= c->plan->n_units) return "?";
  const char *n = sp_plan_unit_fqn(c->plan, unit);
  return n && n[0] ? n : "root";
}

/* "rank 3" / "ranks 0-2, 4-7" */
static void fmt_ranks(const uint32_t *v, size_t n, char *out, size_t cap) {
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

static void fp_words(const sp_coord *c, const fprint *f, char *out,
                     size_t cap) {
  snprintf(out, cap, "%s of unit %u (%s), %s x %" PRIu64, op_name(f->op),
           f->unit, unit_name(c, f->unit), sp_dtype_name((sp_dtype)f->dtype),
           f->count);
}

void sp_coord_diag_last_event(const sp_coord *c, uint32_t rank, char *out,
                              size_t cap) {
  const diag_rank *k = &c->diag->r[rank];
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

/* ---- setup ---- */

/* What one incarnation of the job builds up (tables, verdicts, the
 * ranks' figures), allocated for d's world; the timer is not touched. */
static int diag_alloc(sp_coord *c, sp_coord_diag *d) {
  d->world = c->plan->world_size;
  d->r = calloc(d->world, sizeof *d->r);
  if (d->r == NULL) return SP_ENOMEM;
  if (c->plan->strategy == SP_HYBRID_SHARD &&
      c->plan->shard_world > 0) {
    d->shard_world = c->plan->shard_world;
    d->n_shard = d->world / d->shard_world;
    d->n_replica = d->shard_world;
    d->shard_t = calloc(d->n_shard, sizeof *d->shard_t);
    d->replica_t = calloc(d->n_replica, sizeof *d->replica_t);
    if (d->shard_t == NULL || d->replica_t == NULL) return SP_ENOMEM;
  }
  d->n_kinds = d->shard_t ? N_KINDS : 1;
  d->comms = calloc((size_t)d->world * (size_t)d->n_kinds, sizeof *d->comms);
  if (d->comms == NULL) return SP_ENOMEM;
  for (uint32_t r = 0; r < d->world; r++)
    d->r[r].comm = &d->comms[(size_t)r * (size_t)d->n_kinds];
  d->state = SHARDPLANE__V1__JOB_STATE__JOB_WAITING;
  return 0;
}

int sp_coord_diag_init(sp_coord *c) {
  sp_coord_diag *d = calloc(1, sizeof *d);
  if (d == NULL) return SP_ENOMEM;
  c->diag = d;
  return diag_alloc(c, d);
}

static void diag_clear(sp_coord_diag *d) {
  free(d->world_t.slots);
  for (uint32_t i = 0; d->shard_t && i < d->n_shard; i++)
    free(d->shard_t[i].slots);
  for (uint32_t i = 0; d->replica_t && i < d->n_replica; i++)
    free(d->replica_t[i].slots);
  free(d->shard_t);
  free(d->replica_t);
  free(d->verdict);
  free(d->culprit_msg);
  free(d->comms);
  free(d->r);
}

void sp_coord_diag_free(sp_coord *c) {
  sp_coord_diag *d = c->diag;
  if (d == NULL) return;
  diag_clear(d);
  free(d);
  c->diag = NULL;
}

int sp_coord_diag_new_incarnation(sp_coord *c, void *user,
                                  const sp_coord_event *e) {
  (void)user;
  (void)e;
  sp_coord_diag *d = c->diag;
  diag_clear(d);
  /* everything after the timer fields starts afresh: the next
   * incarnation's collectives count from 0 again, and its verdicts are
   * its own (the timer handle is the loop's and stays where it is) */
  uint64_t forgiven = d->forgiven_ms;
  void (*closed)(void *) = d->closed;
  memset(&d->r, 0, sizeof *d - offsetof(sp_coord_diag, r));
  d->forgiven_ms = forgiven;
  d->closed = closed;
  sp_coord_alerts_close_all(c);
  return diag_alloc(c, d);
}

bool sp_coord_diag_culprit(const sp_coord *c, uint32_t *rank) {
  const sp_coord_diag *d = c->diag;
  if (d == NULL || !d->has_culprit) return false;
  *rank = d->culprit;
  return true;
}

uint64_t sp_coord_diag_forgiven_ms(const sp_coord *c) {
  return c->diag->forgiven_ms;
}

size_t sp_coord_diag_bytes(const sp_coord *c) {
  const sp_coord_diag *d = c->diag;
  size_t n = sizeof *d + (size_t)d->world * (sizeof *d->r +
                                             (size_t)d->n_kinds *
                                                 sizeof *d->comms);
  size_t tables = 1 + d->n_shard + d->n_replica;
  n += tables * (sizeof(comm_table) + COMM_SLOTS * sizeof(comm_slot));
  return n;
}

/* ---- members of a communicator ---- */

static comm_table *table_of(sp_coord_diag *d, int kind, uint32_t index) {
  switch (kind) {
  case SHARDPLANE__V1__COMM_KIND__COMM_WORLD:
    return index == 0 ? &d->world_t : NULL;
  case SHARDPLANE__V1__COMM_KIND__COMM_SHARD:
    return d->shard_t && index < d->n_shard ? &d->shard_t[index] : NULL;
  case SHARDPLANE__V1__COMM_KIND__COMM_REPLICA:
    return d->replica_t && index < d->n_replica ? &d->replica_t[index] : NULL;
  default: return NULL;
  }
}

/* The i-th member (i < n_members), in rank order. */
static uint32_t n_members(const sp_coord_diag *d, int kind) {
  return kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD     ? d->shard_world
         : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA ? d->n_shard
                                                           : d->world;
}

static uint32_t member(const sp_coord_diag *d, int kind, uint32_t index,
                       uint32_t i) {
  return kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD
             ? index * d->shard_world + i
         : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA
             ? i * d->shard_world + index
             : i;
}

static bool member_of(const sp_coord_diag *d, int kind, uint32_t index,
                      uint32_t rank) {
  if (kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD)
    return rank / d->shard_world == index;
  if (kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA)
    return rank % d->shard_world == index;
  return true;
}

static bool fp_eq(const fprint *a, const fprint *b) {
  return a->op == b->op && a->unit == b->unit && a->dtype == b->dtype &&
         a->count == b->count;
}

static bool attached(const sp_coord *c, uint32_t rank);

/* ---- alerts ---- */

static void collective_msg(Shardplane__V1__Collective *m, const fprint *f,
                           int kind, uint32_t index) {
  shardplane__v1__collective__init(m);
  m->seq = f->seq;
  m->op = (Shardplane__V1__CollectiveOp)f->op;
  m->unit = f->unit;
  m->dtype = (Shardplane__V1__DType)f->dtype;
  m->count = f->count;
  m->comm = (Shardplane__V1__CommKind)kind;
  m->comm_index = index;
}

/* When the open alerts' ages are read as of: now, or the job's end (a rank
 * that exited waits no longer). */
static uint64_t ages_as_of(sp_coord *c) {
  sp_coord_diag *d = c->diag;
  bool ended = d->state == SHARDPLANE__V1__JOB_STATE__JOB_FAILED ||
               d->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  return ended ? d->end_ms : sp_coord_base_now_ms(c);
}

size_t sp_coord_diag_open_alerts(sp_coord *c, Shardplane__V1__Alert **out,
                                 size_t cap) {
  return sp_coord_alerts_list_open(c, ages_as_of(c), out, cap);
}

/* The job failed: the first verdict stays. */
static void job_failed(sp_coord *c, const char *verdict) {
  sp_coord_diag *d = c->diag;
  if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_FAILED ||
      d->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED)
    return;
  d->state = SHARDPLANE__V1__JOB_STATE__JOB_FAILED;
  d->end_ms = sp_coord_base_now_ms(c);
  free(d->verdict);
  d->verdict = sp_strdup(verdict);
  d->end_step = d->last_min_step;
  sp_coord_base_log(c, "job FAILED: %s", verdict);
}

static void name_culprit(sp_coord *c, uint32_t rank, const char *msg) {
  sp_coord_diag *d = c->diag;
  if (d->has_culprit) return;
  d->has_culprit = true;
  d->culprit = rank;
  d->culprit_msg = sp_strdup(msg);
}

/* Every rank not among the culprits that is still attached. */
static size_t others(const sp_coord *c, const uint32_t *cul, size_t nc,
                     uint32_t *out) {
  size_t n = 0;
  for (uint32_t r = 0; r < c->diag->world; r++) {
    bool is = false;
    for (size_t i = 0; i < nc; i++) is |= cul[i] == r;
    if (!is && attached(c, r)) out[n++] = r;
  }
  return n;
}

/* The policy after a stall or desync verdict: abort (every rank gets the
 * verdict as its reason) or keep alerting; the dump either way. */
static void after_verdict(sp_coord *c, const char *msg, bool culprit_known,
                          uint32_t culprit, bool stall) {
  if (culprit_known) name_culprit(c, culprit, msg);
  if (stall && c->cfg.diag.abort_on_stall) {
    sp_coord_ranks_abort_all(c, msg, culprit_known, culprit);
    job_failed(c, msg);
  }
  sp_coord_event e = {.kind = SP_COORD_EV_FAULT, .text = msg};
  sp_coord_bus_announce(c, &e);
}

/* ---- desync ---- */

/* Raises the DESYNC alert, unless the sides are tied with members still
 * to be heard from and force is false; whether it did. */
/* How many ranks of the other groups of `kind` issued fingerprint ref at
 * f's seq, less how many issued f. */
static int other_groups_vote(const sp_coord_diag *d, int kind, uint32_t index,
                             const fprint *ref, const fprint *f) {
  if (kind == SHARDPLANE__V1__COMM_KIND__COMM_WORLD) return 0;
  uint32_t groups = kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD
                        ? d->n_shard
                        : d->n_replica;
  int vote = 0;
  for (uint32_t g = 0; g < groups; g++) {
    if (g == index) continue;
    for (uint32_t i = 0; i < n_members(d, kind); i++) {
      const fprint *x =
          &d->r[member(d, kind, g, i)].comm[kind].ring[f->seq % RANK_RING];
      if (x->seq != f->seq) continue;
      vote += fp_eq(x, ref) ? 1 : fp_eq(x, f) ? -1 : 0;
    }
  }
  return vote;
}

static bool desync_alert(sp_coord *c, int kind, uint32_t index,
                         const comm_slot *ref, uint32_t rank,
                         const fprint *f, bool force) {
  sp_coord_diag *d = c->diag;
  uint32_t nm = n_members(d, kind);
  uint32_t *a = calloc((size_t)nm * 3 + 1, sizeof *a);
  if (a == NULL) return true; /* cannot tell: do not try again */
  uint32_t *b = a + nm, *none = b + nm;
  size_t na = 0, nb = 0, nn = 0;
  for (uint32_t i = 0; i < nm; i++) {
    uint32_t r = member(d, kind, index, i);
    const fprint *x = &d->r[r].comm[kind].ring[f->seq % RANK_RING];
    if (x->seq != f->seq) none[nn++] = r;
    else if (fp_eq(x, &ref->f)) a[na++] = r;
    else b[nb++] = r;
  }
  /* a tie inside a shard or replica group: the other groups of its kind
   * run the same program and say which fingerprint belongs at this seq */
  int vote = na == nb ? other_groups_vote(d, kind, index, &ref->f, f) : 0;
  if (!force && na == nb && vote == 0 &&
      (nn > 0 || kind != SHARDPLANE__V1__COMM_KIND__COMM_WORLD)) {
    free(a);
    return false;
  }
  char la[1200], lb[1200], ln[1200] = "", wa[200], wb[200], ea[160], eb[160],
       comm[48];
  fmt_ranks(a, na, la, sizeof la);
  fmt_ranks(b, nb, lb, sizeof lb);
  if (nn) fmt_ranks(none, nn, ln, sizeof ln);
  fp_words(c, &ref->f, wa, sizeof wa);
  fp_words(c, f, wb, sizeof wb);
  sp_coord_diag_last_event(c, na ? a[0] : ref->first_rank, ea, sizeof ea);
  sp_coord_diag_last_event(c, nb ? b[0] : rank, eb, sizeof eb);
  comm_label(kind, index, comm, sizeof comm);
  char msg[SP_DIAG_MAX];
  say(msg, sizeof msg,
           "desync on %s at collective #%" PRIu64 ": %s issued %s (last "
           "event: %s); %s issued %s (last event: %s)%s%s%s",
           comm, f->seq, la, wa, ea, lb, wb, eb, nn ? "; " : "", ln,
           nn == 0 ? "" : nn == 1 ? " has not issued it yet"
                                  : " have not issued it yet");
  /* the smaller side is the odd one out; at a tie, the one the other
   * groups disagree with, else the later one */
  bool b_culprit = na != nb ? nb < na : vote >= 0;
  Shardplane__V1__Collective col;
  collective_msg(&col, b_culprit ? f : &ref->f, kind, index);
  sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__DESYNC,
                             .culprits = b_culprit ? b : a,
                             .n_culprits = b_culprit ? nb : na,
                             .victims = b_culprit ? a : b,
                             .n_victims = b_culprit ? na : nb,
                             .collective = &col};
  sp_coord_alerts_open(c, &in, msg);
  after_verdict(c, msg, true, b_culprit ? b[0] : a[0], false);
  free(a);
  return true;
}

static void ingest_collective(sp_coord *c, uint32_t rank,
                              const Shardplane__V1__Collective *q,
                              uint64_t now) {
  sp_coord_diag *d = c->diag;
  int kind = (int)q->comm;
  if (kind < 0 || kind >= d->n_kinds) return;
  comm_table *t = table_of(d, kind, q->comm_index);
  if (t == NULL || !member_of(d, kind, q->comm_index, rank) || q->seq == 0)
    return;
  diag_rank *k = &d->r[rank];
  fprint f = {.seq = q->seq,
              .count = q->count,
              .unit = q->unit,
              .op = (uint8_t)q->op,
              .dtype = (uint8_t)q->dtype};
  if (q->completed) {
    if (q->seq > k->comm[kind].done_seq) k->comm[kind].done_seq = q->seq;
    time_wait(k, q);
    return;
  }
  if (q->seq > k->comm[kind].issued.seq) {
    k->comm[kind].issued = f;
    k->comm[kind].issued_ms = now;
    k->comm[kind].index = q->comm_index;
  }
  k->comm[kind].ring[q->seq % RANK_RING] = f;
  if (t->slots == NULL) {
    t->slots = calloc(COMM_SLOTS, sizeof *t->slots);
    if (t->slots == NULL) return;
  }
  comm_slot *s = &t->slots[q->seq % COMM_SLOTS];
  if (s->f.seq < q->seq) {
    s->f = f;
    s->first_rank = rank;
  } else if (s->f.seq == q->seq && !t->desynced) {
    if (!fp_eq(&s->f, &f) && !t->pending) {
      t->pending = true;
      t->pending_ms = now;
      t->pending_rank = rank;
      t->pending_f = f;
    }
    /* every fingerprint at the pending seq may break a tie */
    if (t->pending && t->pending_f.seq == q->seq &&
        desync_alert(c, kind, q->comm_index, s, t->pending_rank,
                     &t->pending_f, false)) {
      t->desynced = true;
      t->pending = false;
    }
  }
}

/* A tie still unbroken after DESYNC_TIE_MS: the verdict goes out by the
 * tie rule rather than late. */
static void settle_tie(sp_coord *c, int kind, uint32_t index, uint64_t now) {
  comm_table *t = table_of(c->diag, kind, index);
  if (t == NULL || !t->pending || t->desynced ||
      now - t->pending_ms < DESYNC_TIE_MS)
    return;
  t->pending = false;
  const comm_slot *s = &t->slots[t->pending_f.seq % COMM_SLOTS];
  if (s->f.seq != t->pending_f.seq) return; /* long gone */
  t->desynced = desync_alert(c, kind, index, s, t->pending_rank,
                             &t->pending_f, true);
}

static void settle_ties(sp_coord *c, uint64_t now) {
  sp_coord_diag *d = c->diag;
  settle_tie(c, SHARDPLANE__V1__COMM_KIND__COMM_WORLD, 0, now);
  for (uint32_t i = 0; i < d->n_shard; i++)
    settle_tie(c, SHARDPLANE__V1__COMM_KIND__COMM_SHARD, i, now);
  for (uint32_t i = 0; i < d->n_replica; i++)
    settle_tie(c, SHARDPLANE__V1__COMM_KIND__COMM_REPLICA, i, now);
}

/* ---- ingest ---- */

static bool attached(const sp_coord *c, uint32_t rank) {
  return sp_coord_ranks_attached(c, rank);
}

int sp_coord_diag_transition(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  const Shardplane__V1__Transition *t = e->transition;
  diag_rank *k = &c->diag->r[e->rank];
  k->active = true;
  k->last_event_ms = sp_coord_base_now_ms(c);
  k->last_machine = (uint8_t)t->machine;
  k->last_state = (uint8_t)t->state;
  k->last_unit = t->unit;
  if (t->step > k->last_step) k->last_step = t->step;
  if (time_transition(k, t)) k->judge_due = true;
  return 0;
}

int sp_coord_diag_session_up(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  sp_coord_diag *d = c->diag;
  const Shardplane__V1__SessionUp *q = e->up;
  diag_rank *k = &d->r[e->rank];
  if (q->has_loss && isfinite(q->loss)) {
    k->has_loss = true;
    k->loss = q->loss;
  }
  if (q->total_steps > d->total_steps) d->total_steps = q->total_steps;
  return 0;
}

int sp_coord_diag_collective(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  diag_rank *k = &c->diag->r[e->rank];
  k->active = true;
  k->last_event_ms = e->now_ms;
  ingest_collective(c, e->rank, e->collective, e->now_ms);
  return 0;
}

int sp_coord_diag_session_up_done(sp_coord *c, void *user,
                                  const sp_coord_event *e) {
  (void)user;
  diag_rank *k = &c->diag->r[e->rank];
  /* judged before its waits were taken off, a step counted them as the
   * rank's own time: every rank scored above the median it is part of */
  if (k->judge_due) {
    k->judge_due = false;
    judge_straggler(c, e->rank);
  }
  return 0;
}

int sp_coord_diag_attached(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  sp_coord_diag *d = c->diag;
  diag_rank *k = &d->r[e->rank];
  bool victim = k->victim;
  uint32_t of = k->victim_of;
  rank_comm *comm = k->comm;
  memset(k, 0, sizeof *k);
  memset(comm, 0, (size_t)d->n_kinds * sizeof *comm);
  k->comm = comm;
  k->victim = victim;
  k->victim_of = of;
  k->last_event_ms = sp_coord_base_now_ms(c);
  if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_WAITING) {
    if (sp_coord_ranks_with_status(c, SHARDPLANE__V1__RANK_STATUS__ATTACHED) <
        d->world)
      return 0;
    d->state = SHARDPLANE__V1__JOB_STATE__JOB_RUNNING;
    d->ever_running = true;
    d->rate_t0_ms = sp_coord_base_now_ms(c);
    d->rate_step0 = 0;
    sp_coord_base_log(c, "job RUNNING: all %u ranks attached", d->world);
  }
  return 0;
}

int sp_coord_diag_detached(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  (void)e;
  sp_coord_diag *d = c->diag;
  if (d->state != SHARDPLANE__V1__JOB_STATE__JOB_RUNNING ||
      sp_coord_ranks_with_status(c, SHARDPLANE__V1__RANK_STATUS__DETACHED) <
          d->world)
    return 0;
  /* once, when the last rank detached */
  uint64_t step = 0;
  for (uint32_t r = 0; r < d->world; r++)
    if (sp_coord_ranks_step(c, r) > step) step = sp_coord_ranks_step(c, r);
  d->state = SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  d->end_step = step;
  d->end_ms = sp_coord_base_now_ms(c);
  sp_coord_base_log(c, "job COMPLETED at step %" PRIu64, step);
  sp_coord_event done = {.kind = SP_COORD_EV_COMPLETED, .step = step};
  sp_coord_bus_announce(c, &done);
  return 0;
}

void sp_coord_diag_restore_completed(sp_coord *c) {
  sp_coord_diag *d = c->diag;
  uint64_t step = 0;
  for (uint32_t r = 0; r < d->world; r++)
    if (sp_coord_ranks_step(c, r) > step) step = sp_coord_ranks_step(c, r);
  d->state = SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  d->ever_running = true;
  d->end_step = step;
  d->end_ms = sp_coord_base_now_ms(c);
}

int sp_coord_diag_lost(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  sp_coord_diag *d = c->diag;
  uint32_t rank = e->rank;
  const char *why = e->text;
  char *reason = e->out;
  size_t cap = e->cap;
  uint32_t *culprit = e->culprit;
  if (d->has_culprit && d->culprit != rank) {
    d->r[rank].victim = true;
    d->r[rank].victim_of = d->culprit;
    sp_coord_base_log(c, "rank %u lost after rank %u's fault (a victim): %s",
                      rank, d->culprit, why);
    snprintf(reason, cap, "%s",
             d->verdict ? d->verdict
                        : d->culprit_msg ? d->culprit_msg : "a peer failed");
    *culprit = d->culprit;
    job_failed(c, reason);
    return 0;
  }
  *culprit = rank;
  char msg[SP_DIAG_MAX];
  say(msg, sizeof msg, "rank %u was lost: %s", rank, why);
  name_culprit(c, rank, msg);
  uint32_t *v = malloc((size_t)d->world * sizeof *v);
  size_t nv = v ? others(c, &rank, 1, v) : 0;
  sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__ALERT_LOST,
                             .culprits = &rank,
                             .n_culprits = 1,
                             .victims = v,
                             .n_victims = nv};
  sp_coord_alerts_open(c, &in, msg);
  free(v);
  snprintf(reason, cap, "%s", msg);
  if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING) job_failed(c, msg);
  if (!c->shutting_down) {
    sp_coord_event fault = {.kind = SP_COORD_EV_FAULT, .text = msg};
    sp_coord_bus_announce(c, &fault);
  }
  return 0;
}

int sp_coord_diag_aborted(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  job_failed(c, e->text);
  return 0;
}

int sp_coord_diag_refuse_attach(sp_coord *c, void *user,
                                const sp_coord_event *e) {
  (void)user;
  const sp_coord_diag *d = c->diag;
  char *msg = e->out;
  size_t cap = e->cap;
  if (d->state != SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED &&
      d->state != SHARDPLANE__V1__JOB_STATE__JOB_FAILED)
    return 0;
  bool ok = d->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  snprintf(msg, cap, "the job ended (%s at step %" PRIu64 "%s%.300s); start "
           "a new coordinator",
           ok ? "COMPLETED" : "FAILED", d->end_step, ok ? "" : ": ",
           ok ? "" : (d->verdict ? d->verdict : ""));
  return SP_ESTATE;
}

/* ---- stall ---- */

uint64_t sp_coord_diag_stall_threshold(const sp_coord *c) {
  if (c->cfg.diag.stall_timeout_ms) return c->cfg.diag.stall_timeout_ms;
  const sp_coord_diag *d = c->diag;
  float p99 = 0;
  for (uint32_t r = 0; r < d->world; r++) {
    const diag_rank *k = &d->r[r];
    if (k->n_steps == 0) continue;
    float x = pct_of(k->step_ms, k->n_steps, 0.99);
    if (x > p99) p99 = x;
  }
  uint64_t adaptive = (uint64_t)(SP_DIAG_STALL_K * p99);
  return adaptive > SP_DIAG_STALL_FLOOR_MS ? adaptive : SP_DIAG_STALL_FLOOR_MS;
}

static bool in_collective(const sp_coord_diag *d, const diag_rank *k) {
  for (int kind = 0; kind < d->n_kinds; kind++)
    if (k->comm[kind].issued.seq > k->comm[kind].done_seq) return true;
  return false;
}

/* Whether the open collective (kind, index, f) has members that have not
 * issued it and wait in no collective themselves: the end of the chain of
 * waits (ranks 0-1 wait in the world for rank 2, which waits in its shard
 * group for rank 3, which is in none: rank 3 is the one to name). */
static bool waits_on_a_root(const sp_coord *c, int kind, uint32_t index,
                            const fprint *f) {
  const sp_coord_diag *d = c->diag;
  bool any = false;
  for (uint32_t i = 0; i < n_members(d, kind); i++) {
    uint32_t r = member(d, kind, index, i);
    const diag_rank *k = &d->r[r];
    if (k->comm[kind].issued.seq >= f->seq) continue;
    if (sp_coord_ranks_status(c, r) ==
        SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED)
      continue;
    if (attached(c, r) && in_collective(d, k)) return false;
    any = true;
  }
  return any;
}

/* The collective to explain the stall by: the earliest-issued open one
 * whose missing members wait on nothing, else the earliest-issued open
 * one. */
static bool find_waited(const sp_coord *c, int *kind_out, uint32_t *index_out,
                        fprint *f_out) {
  const sp_coord_diag *d = c->diag;
  bool found = false, rooted = false;
  uint64_t oldest = UINT64_MAX;
  for (uint32_t r = 0; r < d->world; r++) {
    if (!attached(c, r)) continue;
    const diag_rank *k = &d->r[r];
    for (int kind = 0; kind < d->n_kinds; kind++) {
      if (k->comm[kind].issued.seq == 0 ||
          k->comm[kind].done_seq >= k->comm[kind].issued.seq)
        continue;
      bool root = waits_on_a_root(c, kind, k->comm[kind].index,
                                  &k->comm[kind].issued);
      if ((root && !rooted) ||
          (root == rooted && k->comm[kind].issued_ms < oldest)) {
        oldest = k->comm[kind].issued_ms;
        rooted = root;
        *kind_out = kind;
        *index_out = k->comm[kind].index;
        *f_out = k->comm[kind].issued;
        found = true;
      }
    }
  }
  return found;
}

/* Sorts the members of communicator (kind, index) by collective f: those
 * that issued it and wait in it, and those that have not issued it.
 * Returns when the earliest of them issued it (coordinator clock), or now
 * when that is not known. */
static uint64_t classify(const sp_coord *c, int kind, uint32_t index,
                         const fprint *fp, uint64_t now, uint32_t *waiting,
                         size_t *nw_out, uint32_t *missing,
                         size_t *nmiss_out) {
  const sp_coord_diag *d = c->diag;
  size_t nw = 0, nmiss = 0;
  uint64_t since = now;
  for (uint32_t i = 0; i < n_members(d, kind); i++) {
    uint32_t r = member(d, kind, index, i);
    const diag_rank *k = &d->r[r];
    if (!attached(c, r)) {
      /* a member that left (detached after fewer steps, say) never
       * issues it: it is the one the others wait for */
      if (k->comm[kind].issued.seq < fp->seq &&
          sp_coord_ranks_status(c, r) !=
              SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED)
        missing[nmiss++] = r;
      continue;
    }
    if (k->comm[kind].issued.seq >= fp->seq &&
        k->comm[kind].done_seq < fp->seq) {
      waiting[nw++] = r;
      /* how long: from the earliest issue of this very collective */
      if (k->comm[kind].issued.seq == fp->seq &&
          k->comm[kind].issued_ms < since)
        since = k->comm[kind].issued_ms;
    } else if (k->comm[kind].issued.seq < fp->seq) {
      missing[nmiss++] = r;
    }
  }
  *nw_out = nw;
  *nmiss_out = nmiss;
  return since;
}

static void stall_verdict(sp_coord *c, uint64_t now, uint64_t thr) {
  sp_coord_diag *d = c->diag;
  uint32_t *waiting = malloc((size_t)d->world * 2 * sizeof *waiting);
  if (waiting == NULL) return;
  uint32_t *missing = waiting + d->world;
  size_t nw = 0, nmiss = 0;
  int kind = 0;
  uint32_t index = 0;
  fprint f = {0};
  char msg[SP_DIAG_MAX], tmpl[SP_DIAG_MAX], lw[1200], lm[1200], words[200],
      comm[48], ev[160];
  if (find_waited(c, &kind, &index, &f)) {
    uint64_t since =
        classify(c, kind, index, &f, now, waiting, &nw, missing, &nmiss);
    /* The collective the job waits in is the first one some member has
     * not issued: a rank several collectives ahead (prefetch) waits there,
     * not in its last one, and a laggard's own last collective may still
     * be open only because its thread stopped before waiting on it. */
    uint64_t lo = UINT64_MAX, hi = 0;
    for (uint32_t i = 0; i < n_members(d, kind); i++) {
      uint32_t r = member(d, kind, index, i);
      if (sp_coord_ranks_status(c, r) ==
          SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED)
        continue;
      uint64_t q = d->r[r].comm[kind].issued.seq;
      if (q < lo) lo = q;
      if (q > hi) hi = q;
    }
    const comm_table *t = table_of(d, kind, index);
    if (lo < hi && lo + 1 != f.seq && t && t->slots &&
        t->slots[(lo + 1) % COMM_SLOTS].f.seq == lo + 1) {
      f = t->slots[(lo + 1) % COMM_SLOTS].f;
      since = classify(c, kind, index, &f, now, waiting, &nw, missing,
                       &nmiss);
    }
    if (since == now) since = now - thr;
    double secs = (double)(now - since) / 1000.0;
    /* the seconds are rendered as of each reading
     * (sp_coord_alerts_list_open) */
    comm_label(kind, index, comm, sizeof comm);
    fmt_ranks(waiting, nw, lw, sizeof lw);
    Shardplane__V1__Collective col;
    collective_msg(&col, &f, kind, index);
    if (nmiss > 0) {
      fmt_ranks(missing, nmiss, lm, sizeof lm);
      sp_coord_diag_last_event(c, missing[0], ev, sizeof ev);
      int st = sp_coord_ranks_status(c, missing[0]);
      const char *then = st == SHARDPLANE__V1__RANK_STATUS__DETACHED
                             ? " (then it detached)"
                         : st == SHARDPLANE__V1__RANK_STATUS__LOST
                             ? " (then it was lost)"
                             : "";
      say(tmpl, sizeof tmpl,
          "%s %s not issued %s #%" PRIu64
          " of unit %u (%s) on %s; %s %s "
          "been waiting in it for %s s; rank %u's last event: %s%s",
          lm, nmiss == 1 ? "has" : "have", op_name(f.op), f.seq, f.unit,
          unit_name(c, f.unit), comm, lw, nw == 1 ? "has" : "have",
          SP_COORD_ALERTS_AGE, missing[0], ev, then);
      sp_coord_alerts_render_age(tmpl, secs, msg, sizeof msg);
      sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__STALL,
                                 .culprits = missing,
                                 .n_culprits = nmiss,
                                 .victims = waiting,
                                 .n_victims = nw,
                                 .collective = &col,
                                 .tmpl = tmpl,
                                 .since_ms = since};
      sp_coord_alerts_open(c, &in, msg);
      after_verdict(c, msg, true, missing[0], true);
    } else {
      fp_words(c, &f, words, sizeof words);
      say(tmpl, sizeof tmpl,
          "every member of %s (%s) issued %s, collective #%" PRIu64
          ", and none has completed it for %s s: the network or the "
          "collective library, not a rank",
          comm, lw, words, f.seq, SP_COORD_ALERTS_AGE);
      sp_coord_alerts_render_age(tmpl, secs, msg, sizeof msg);
      sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__STALL,
                                 .victims = waiting,
                                 .n_victims = nw,
                                 .collective = &col,
                                 .tmpl = tmpl,
                                 .since_ms = since};
      sp_coord_alerts_open(c, &in, msg);
      after_verdict(c, msg, false, 0, true);
    }
  } else {
    /* nobody in a collective: the silent ranks themselves */
    for (uint32_t r = 0; r < d->world; r++)
      if (attached(c, r) && d->r[r].active &&
          now - d->r[r].last_event_ms > thr)
        missing[nmiss++] = r;
    if (nmiss == 0) {
      free(waiting);
      return;
    }
    fmt_ranks(missing, nmiss, lm, sizeof lm);
    sp_coord_diag_last_event(c, missing[0], ev, sizeof ev);
    uint64_t since = d->r[missing[0]].last_event_ms;
    say(tmpl, sizeof tmpl,
        "%s made no progress for %s s while heartbeating, in no "
        "collective; rank %u's last event: %s",
        lm, SP_COORD_ALERTS_AGE, missing[0], ev);
    sp_coord_alerts_render_age(tmpl, (double)(now - since) / 1000.0, msg,
                               sizeof msg);
    nw = others(c, missing, nmiss, waiting);
    sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__STALL,
                               .culprits = missing,
                               .n_culprits = nmiss,
                               .victims = waiting,
                               .n_victims = nw,
                               .tmpl = tmpl,
                               .since_ms = since};
    sp_coord_alerts_open(c, &in, msg);
    after_verdict(c, msg, true, missing[0], true);
  }
  free(waiting);
}

static void check_stall(sp_coord *c, uint64_t now) {
  sp_coord_diag *d = c->diag;
  if (d->state != SHARDPLANE__V1__JOB_STATE__JOB_RUNNING) return;
  uint64_t thr = sp_coord_diag_stall_threshold(c);
  bool any = false, moving = false;
  for (uint32_t r = 0; r < d->world; r++) {
    if (!attached(c, r) || !d->r[r].active) continue;
    if (now - d->r[r].last_event_ms > thr) any = true;
    else if (now - d->r[r].last_event_ms < SP_DIAG_TICK_MS * 2) moving = true;
  }
  if (!any) {
    if (d->stall_open) {
      d->stall_open = false;
      sp_coord_alerts_close(c, SHARDPLANE__V1__ALERT_KIND__STALL, true, 0);
      sp_coord_base_log(c, "the stall is over: every rank moves again");
    }
    return;
  }
  (void)moving;
  if (d->stall_open) return;
  d->stall_open = true;
  stall_verdict(c, now, thr);
}

/* ---- straggler ---- */

/* The k-th smallest of v[0..n) (k < n), reordering v: Hoare's selection,
 * O(n) on average where sorting was O(n log n). Every 200 ms over the
 * whole world: for 100,000 medians qsort took 14.9 ms of each tick, this
 * 1.0 ms (best of 7 on a loaded machine). */
static float select_kth(float *v, size_t n, size_t k) {
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
    if (k <= j) hi = j;
    else if (k >= i) lo = i;
    else break; /* between the halves: equal to the pivot */
  }
  return v[k];
}

/* The median of v[0..n) (n > 0), reordering v. */
static float select_median(float *v, size_t n) {
  float hi = select_kth(v, n, n / 2);
  if (n % 2) return hi;
  /* the other middle one: the largest of the lower half */
  float lo = v[0];
  for (size_t i = 1; i < n / 2; i++)
    if (v[i] > lo) lo = v[i];
  return (lo + hi) / 2;
}

/* Judged at each of the rank's step closes (once the message that closed
 * it was read: sp_coord_diag_session_up), against the job's median of
 * the last tick, so that the 4 steps it must stay over the bar are steps,
 * not ticks: judged on the 200 ms tick alone, a job of 20 ms steps moved
 * 10 steps between judgements and a 1.5x slow rank was flagged at step
 * 25 instead of 14 on a loaded machine. */
static void judge_straggler(sp_coord *c, uint32_t r) {
  sp_coord_diag *d = c->diag;
  diag_rank *k = &d->r[r];
  float job_med = d->job_med;
  if (job_med <= 0 || !attached(c, r) || k->n_steps < SP_DIAG_STEP_WINDOW / 2)
    return;
  double ratio = c->cfg.diag.straggler_ratio > 1.0 ? c->cfg.diag.straggler_ratio
                                                   : 1.3;
  /* a floor of 1 ms keeps near-zero compute from making ratios */
  float base = job_med > 1.0f ? job_med : 1.0f;
  k->score = k->busy_med / base;
  float step = median_of(k->step_ms, k->n_steps);
  /* The bar is crossed by its faster steps too (the 25th percentile):
   * a process a busy host deschedules now and then has slow steps among
   * normal ones, a straggler has no normal ones. And it must cost the
   * job: the excess a tenth of a step and 2 ms at least (a few ms of
   * compute in a step of tens jitters by half on a loaded machine, and
   * nobody waits for that). */
  float excess = k->busy_med - job_med, lo_excess = k->busy_lo - job_med;
  bool over = lo_excess >= 2.0f && lo_excess >= 0.1f * step &&
              k->busy_lo / base >= ratio;
  /* and for a stretch of steps: a process descheduled for a while on a
   * busy host crosses the bar for a window, a straggler stays over it */
  if (!over)
    k->over_since = 0;
  else if (k->over_since == 0)
    k->over_since = k->cur_step + 1;
  if (!k->straggling && over &&
      k->cur_step + 1 >= k->over_since + SP_DIAG_STRAGGLER_STEPS) {
    k->straggling = true;
    char msg[SP_DIAG_MAX];
    say(msg, sizeof msg,
        "rank %u is a straggler: its own time (the step less its "
        "waits on peers) is %.2fx the job's median%s, %.1f ms a step "
        "against %.1f ms over its last %u steps (%.1f ms or more in "
        "three steps of four); each step takes %.1f ms, and the "
        "other ranks spend about %.1f ms of it waiting for rank %u "
        "in collectives",
        r, (double)k->score, job_med < base ? " (taken as 1 ms at least)" : "",
        (double)k->busy_med, (double)job_med, (unsigned)k->n_steps,
        (double)k->busy_lo, (double)step, (double)excess, r);
    uint32_t *v = malloc((size_t)d->world * sizeof *v);
    size_t nv = v ? others(c, &r, 1, v) : 0;
    sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__STRAGGLER,
                               .culprits = &r,
                               .n_culprits = 1,
                               .victims = v,
                               .n_victims = nv};
    sp_coord_alerts_open(c, &in, msg);
    free(v);
  } else if (k->straggling && k->score < (ratio + 1.0) / 2) {
    k->straggling = false;
    sp_coord_alerts_close(c, SHARDPLANE__V1__ALERT_KIND__STRAGGLER, false, r);
  }
}

static void check_stragglers(sp_coord *c) {
  sp_coord_diag *d = c->diag;
  float *meds = malloc((size_t)d->world * sizeof *meds);
  if (meds == NULL) return;
  size_t n = 0;
  for (uint32_t r = 0; r < d->world; r++)
    if (attached(c, r) && d->r[r].n_steps >= SP_DIAG_STEP_WINDOW / 2)
      meds[n++] = d->r[r].busy_med;
  if (n < 2) {
    free(meds);
    d->job_med = 0;
    return;
  }
  /* the median of the medians, every tick: linear in the world */
  d->job_med = select_median(meds, n);
  free(meds);
  for (uint32_t r = 0; r < d->world; r++) judge_straggler(c, r);
}


/* ---- progress ---- */

static void update_progress(sp_coord *c, uint64_t now) {
  sp_coord_diag *d = c->diag;
  uint64_t min_step = UINT64_MAX;
  for (uint32_t r = 0; r < d->world; r++)
    if (attached(c, r)) {
      uint64_t s = sp_coord_ranks_step(c, r);
      if (s < min_step) min_step = s;
    }
  if (min_step == UINT64_MAX) return;
  d->last_min_step = min_step;
  if (d->state != SHARDPLANE__V1__JOB_STATE__JOB_RUNNING) return;
  if (d->rate_step0 == 0 && min_step > 0) {
    d->rate_step0 = min_step;
    d->rate_t0_ms = now;
  } else if (min_step > d->rate_step0 && now > d->rate_t0_ms + 500) {
    double rate = (double)(min_step - d->rate_step0) * 1000.0 /
                  (double)(now - d->rate_t0_ms);
    d->steps_per_s = d->steps_per_s > 0 ? 0.7 * d->steps_per_s + 0.3 * rate
                                        : rate;
    d->rate_step0 = min_step;
    d->rate_t0_ms = now;
  } else if (now > d->rate_t0_ms + 10000 && min_step == d->rate_step0) {
    d->steps_per_s = 0;
  }
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
    for (uint32_t r = 0; r < d->world; r++) {
      diag_rank *k = &d->r[r];
      k->last_event_ms += late;
      if (k->last_event_ms > now) k->last_event_ms = now;
      for (int i = 0; i < d->n_kinds; i++) {
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
  settle_ties(c, now);
  update_progress(c, now);
  check_stall(c, now);
  check_stragglers(c);
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

/* ---- what GetJob, ListRanks and GetVerdict say ---- */

static double job_loss(const sp_coord *c, bool *has) {
  const sp_coord_diag *d = c->diag;
  for (uint32_t r = 0; r < d->world; r++)
    if (d->r[r].has_loss) {
      *has = true;
      return d->r[r].loss;
    }
  *has = false;
  return 0;
}

/* How long rank r may be silent (ms) before it is worth saying that it
 * makes no progress (`why`: NOTICE), and before it counts as stuck rather
 * than in a long stretch of its step (GetJob's quiet_limit_ms, which
 * decides whether a stop on a signal waits for the ranks: STUCK, with the
 * margin a loaded machine's slower steps need): a multiple of the longest
 * gap between its transitions in its recent steps and the one under way,
 * at least a floor, at most the stall threshold. A GPT-2 124M step of 30 s
 * on a CPU has gaps of up to 5 s: a rank silent for much longer is stuck,
 * well before the threshold (five of the slowest steps) calls it a
 * stall. */
#define NOTICE_FACTOR 2.0f
#define NOTICE_FLOOR_MS 2000u
#define STUCK_FACTOR 3.0f
#define STUCK_FLOOR_MS 5000u

static uint64_t silence_limit_ms(sp_coord *c, uint32_t r, float factor,
                                 uint64_t floor_ms) {
  const diag_rank *k = &c->diag->r[r];
  uint64_t thr = sp_coord_diag_stall_threshold(c);
  float gap = k->gap_max_ms > k->gap_cur_ms ? k->gap_max_ms : k->gap_cur_ms;
  uint64_t lim = (uint64_t)(factor * gap);
  if (lim < floor_ms) lim = floor_ms;
  return lim < thr ? lim : thr;
}

/* Of the ranks the stall detector weighs (attached and active), the one
 * furthest past its silence limit (or nearest to it): its silence and
 * limit. False when there is none. */
static bool most_silent(sp_coord *c, uint64_t now, float factor,
                        uint64_t floor_ms, uint64_t *quiet, uint64_t *limit) {
  sp_coord_diag *d = c->diag;
  bool any = false;
  double worst = 0;
  for (uint32_t r = 0; r < d->world; r++) {
    if (!attached(c, r) || !d->r[r].active) continue;
    uint64_t q = now > d->r[r].last_event_ms ? now - d->r[r].last_event_ms
                                             : 0;
    uint64_t l = silence_limit_ms(c, r, factor, floor_ms);
    double over = (double)q / (double)l;
    if (!any || over > worst) {
      worst = over;
      *quiet = q;
      *limit = l;
      any = true;
    }
  }
  return any;
}

void sp_coord_diag_job(sp_coord *c, Shardplane__V1__GetJobResponse *r,
                       Shardplane__V1__Progress *p) {
  sp_coord_diag *d = c->diag;
  r->state = d->state;
  r->verdict = d->verdict ? d->verdict : (char *)"";
  shardplane__v1__progress__init(p);
  p->step = d->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING ||
                    d->state == SHARDPLANE__V1__JOB_STATE__JOB_WAITING
                ? d->last_min_step
                : d->end_step;
  p->total_steps = d->total_steps;
  p->steps_per_s = d->steps_per_s;
  bool has;
  p->loss = job_loss(c, &has);
  p->has_loss = has;
  p->eta_s = d->total_steps > p->step && d->steps_per_s > 0
                 ? (double)(d->total_steps - p->step) / d->steps_per_s
                 : (d->total_steps && d->total_steps <= p->step ? 0 : -1);
  r->progress = p;
  uint64_t quiet, limit;
  if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING &&
      most_silent(c, sp_coord_base_now_ms(c), STUCK_FACTOR, STUCK_FLOOR_MS,
                  &quiet, &limit)) {
    r->quiet_ms = quiet;
    r->quiet_limit_ms = limit;
  }
  r->stall_threshold_ms = sp_coord_diag_stall_threshold(c);
}

int sp_coord_diag_rank_info(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  Shardplane__V1__RankInfo *x = e->info;
  const diag_rank *k = &c->diag->r[e->rank];
  x->step_p50_ms = pct_of(k->step_ms, k->n_steps, 0.50);
  x->step_p90_ms = pct_of(k->step_ms, k->n_steps, 0.90);
  x->step_p99_ms = pct_of(k->step_ms, k->n_steps, 0.99);
  x->straggler_score = k->n_steps ? k->score : 0;
  x->victim = k->victim;
  x->victim_of = k->victim_of;
  return 0;
}

bool sp_coord_diag_verdict(sp_coord *c, char *headline, size_t hcap,
                           char *text, size_t tcap) {
  sp_coord_diag *d = c->diag;
  Shardplane__V1__Alert *open[SP_COORD_ALERTS_MAX_OPEN];
  size_t n_open = sp_coord_alerts_list_open(c, ages_as_of(c), open,
                                            SP_COORD_ALERTS_MAX_OPEN);
  uint64_t now = sp_coord_base_now_ms(c), quiet, limit;
  uint32_t n_att = 0;
  for (uint32_t r = 0; r < d->world; r++) n_att += attached(c, r);
  text[0] = '\0';
  if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_FAILED) {
    snprintf(headline, hcap, "failed at step %" PRIu64 ": %s", d->end_step,
             d->verdict ? d->verdict : "");
  } else if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED) {
    snprintf(headline, hcap, "completed: all %u ranks finished at step %" PRIu64,
             d->world, d->end_step);
    snprintf(text, tcap, "%s", headline);
    return true;
  } else if (d->state == SHARDPLANE__V1__JOB_STATE__JOB_WAITING) {
    snprintf(headline, hcap, "waiting: %u of %u ranks attached", n_att,
             d->world);
  } else if (n_open == 0 &&
             most_silent(c, now, NOTICE_FACTOR, NOTICE_FLOOR_MS, &quiet,
                         &limit) &&
             quiet > limit) {
    /* well before a stall alert opens, an operator asking `why` of a job
     * that stopped moving must not read "healthy"; not naming the quiet
     * rank: in a collective the waiting ranks fall silent too, and may
     * have done so first; the stall verdict tells them apart */
    snprintf(headline, hcap, "no progress for %.0f s: the slowest of the %u "
             "ranks is at step %" PRIu64 " and one has reported nothing "
             "since (a stall alert naming the culprit opens after %.0f s)",
             (double)quiet / 1e3, d->world, d->last_min_step,
             (double)sp_coord_diag_stall_threshold(c) / 1e3);
  } else if (n_open == 0) {
    bool has;
    double loss = job_loss(c, &has);
    char tail[64] = "";
    if (has) snprintf(tail, sizeof tail, ", loss %.4g", loss);
    snprintf(headline, hcap, "healthy: all %u ranks at step %" PRIu64
             ", %.1f steps/s%s", d->world, d->last_min_step, d->steps_per_s,
             tail);
  } else {
    snprintf(headline, hcap, "%s", open[n_open - 1]->message);
  }
  size_t used = 0;
  for (size_t i = 0; i < n_open && used + 1 < tcap; i++) {
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
        &shardplane__v1__alert_kind__descriptor, open[i]->kind);
    int w = snprintf(text + used, tcap - used, "%s%s: %s", used ? "\n" : "",
                     v ? v->name : "?", open[i]->message);
    if (w < 0) break;
    used += (size_t)w < tcap - used ? (size_t)w : tcap - used - 1;
  }
  if (used == 0) snprintf(text, tcap, "%s", headline);
  return d->state != SHARDPLANE__V1__JOB_STATE__JOB_FAILED && n_open == 0;
}

static sp_coord *coord_of(sp_rpc_call *call) {
  return sp_rpc_call_method_user(call);
}

static void on_get_verdict(sp_rpc_call *call, const ProtobufCMessage *msg,
                           const uint8_t *raw, size_t len) {
  (void)msg;
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  char headline[SP_DIAG_MAX], text[8192];
  Shardplane__V1__Verdict v = SHARDPLANE__V1__VERDICT__INIT;
  v.healthy =
      sp_coord_diag_verdict(c, headline, sizeof headline, text, sizeof text);
  v.headline = headline;
  v.text = text;
  Shardplane__V1__Alert *open[32];
  v.n_open_alerts = sp_coord_diag_open_alerts(c, open, 32);
  v.open_alerts = open;
  Shardplane__V1__GetJobResponse jr = SHARDPLANE__V1__GET_JOB_RESPONSE__INIT;
  Shardplane__V1__Progress p;
  sp_coord_diag_job(c, &jr, &p);
  v.state = jr.state;
  v.progress = &p;
  sp_rpc_call_reply(call, &v.base);
}

static const sp_rpc_method k_methods[] = {
    {SP_COORD_PATH("GetVerdict"), SP_RPC_UNARY,
     &shardplane__v1__get_verdict_request__descriptor, on_get_verdict, NULL,
     NULL, NULL},
};

int sp_coord_diag_register(sp_coord *c) {
  return sp_coord_base_add_methods(c, k_methods, 1);
}
