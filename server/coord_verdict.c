/* The job's state, its culprit and victims, its progress, and the words
 * GetVerdict, GetJob and ListRanks say about it. */
#include "coord_verdict.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_agents.h"
#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_diag.h"
#include "coord_ranks.h"
#include "coord_quorum.h"

/* What the verdict keeps of one rank. */
typedef struct verdict_rank {
  double loss;
  uint32_t victim_of;
  bool victim;   /* of victim_of, kept when the rank attaches again */
  bool has_loss; /* loss holds one */
} verdict_rank;

struct sp_coord_verdict {
  uint32_t world;
  verdict_rank *r;
  Shardplane__V1__JobState state;
  char *verdict; /* FAILED */
  uint64_t end_step;
  bool has_culprit;
  uint32_t culprit;
  char *culprit_msg; /* the verdict that named it */
  uint64_t total_steps;
  /* progress: the slowest rank's step at two moments */
  uint64_t rate_t0_ms, rate_step0;
  double steps_per_s;
  uint64_t last_min_step;
  uint64_t end_ms; /* when the job FAILED or COMPLETED: ages stop */
};

/* One incarnation's state, for the world: WAITING. */
static int verdict_alloc(sp_coord *c, struct sp_coord_verdict *v) {
  v->world = c->plan->world_size;
  v->r = calloc(v->world, sizeof *v->r);
  if (v->r == NULL) return SP_ENOMEM;
  v->state = SHARDPLANE__V1__JOB_STATE__JOB_WAITING;
  return 0;
}

static void verdict_clear(struct sp_coord_verdict *v) {
  free(v->r);
  free(v->verdict);
  free(v->culprit_msg);
  memset(v, 0, sizeof *v);
}

int sp_coord_verdict_init(sp_coord *c) {
  c->verdict = calloc(1, sizeof *c->verdict);
  if (c->verdict == NULL) return SP_ENOMEM;
  return verdict_alloc(c, c->verdict);
}

void sp_coord_verdict_free(sp_coord *c) {
  if (c->verdict == NULL) return;
  verdict_clear(c->verdict);
  free(c->verdict);
  c->verdict = NULL;
}

int sp_coord_verdict_new_incarnation(sp_coord *c, void *user,
                                     const sp_coord_event *e) {
  (void)user;
  (void)e;
  verdict_clear(c->verdict);
  return verdict_alloc(c, c->verdict);
}

Shardplane__V1__JobState sp_coord_verdict_state(const sp_coord *c) {
  return c->verdict->state;
}

bool sp_coord_verdict_culprit(const sp_coord *c, uint32_t *rank) {
  const struct sp_coord_verdict *v = c->verdict;
  if (v == NULL || !v->has_culprit) return false;
  *rank = v->culprit;
  return true;
}

static bool ended(const struct sp_coord_verdict *v) {
  return v->state == SHARDPLANE__V1__JOB_STATE__JOB_FAILED ||
         v->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
}

/* The job failed: the first verdict stays. */
static void job_failed(sp_coord *c, const char *verdict) {
  struct sp_coord_verdict *v = c->verdict;
  if (ended(v)) return;
  v->state = SHARDPLANE__V1__JOB_STATE__JOB_FAILED;
  v->end_ms = sp_coord_base_now_ms(c);
  free(v->verdict);
  v->verdict = sp_strdup(verdict);
  v->end_step = v->last_min_step;
  sp_coord_base_log(c, "job FAILED: %s", verdict);
}

static void name_culprit(sp_coord *c, uint32_t rank, const char *msg) {
  struct sp_coord_verdict *v = c->verdict;
  if (v->has_culprit) return;
  v->has_culprit = true;
  v->culprit = rank;
  v->culprit_msg = sp_strdup(msg);
}

/* The dump of a fault (coord_dump.c). */
static void announce_fault(sp_coord *c, const char *msg) {
  sp_coord_event e = {.kind = SP_COORD_EV_FAULT, .text = msg};
  sp_coord_bus_announce(c, &e);
}

void sp_coord_verdict_fault(sp_coord *c, const char *msg, bool culprit_known,
                            uint32_t culprit, bool stall) {
  /* replica groups that continue: a stalled rank's group is dropped (its
   * agent restarts it, and it rejoins) and the job trains on, with no
   * culprit of its own; a group rejoining is waited for (the alert
   * stays open while it is late) */
  if (stall && culprit_known &&
      (sp_coord_quorum_settling(c, culprit) ||
       sp_coord_quorum_drop(c, culprit, msg, SP_COORD_CAUSE_STALL))) {
    announce_fault(c, msg);
    return;
  }
  if (culprit_known) name_culprit(c, culprit, msg);
  bool aborting = stall && c->cfg.diag.abort_on_stall;
  if (aborting) job_failed(c, msg);
  /* the dump's FLIGHT_DUMP goes down each stream before the ABORT: a rank
   * answers it as it comes, while one told to abort first may be gone
   * before the request reaches it, and the dump would lack its record */
  announce_fault(c, msg);
  if (aborting) sp_coord_ranks_abort_all(c, msg, culprit_known, culprit);
}

/* ---- the ranks' events ---- */

int sp_coord_verdict_refuse_attach(sp_coord *c, void *user,
                                   const sp_coord_event *e) {
  (void)user;
  const struct sp_coord_verdict *v = c->verdict;
  if (!ended(v)) return 0;
  bool ok = v->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  snprintf(e->out, e->cap,
           "the job ended (%s at step %" PRIu64
           "%s%.300s); start a new coordinator",
           ok ? "COMPLETED" : "FAILED", v->end_step, ok ? "" : ": ",
           ok ? "" : (v->verdict ? v->verdict : ""));
  return SP_ESTATE;
}

int sp_coord_verdict_attached(sp_coord *c, void *user,
                              const sp_coord_event *e) {
  (void)user;
  struct sp_coord_verdict *v = c->verdict;
  verdict_rank *k = &v->r[e->rank];
  k->has_loss = false;
  k->loss = 0;
  if (v->state == SHARDPLANE__V1__JOB_STATE__JOB_WAITING) {
    if (sp_coord_ranks_with_status(c, SHARDPLANE__V1__RANK_STATUS__ATTACHED) <
        v->world)
      return 0;
    v->state = SHARDPLANE__V1__JOB_STATE__JOB_RUNNING;
    v->rate_t0_ms = sp_coord_base_now_ms(c);
    v->rate_step0 = 0;
    sp_coord_base_log(c, "job RUNNING: all %u ranks attached", v->world);
  }
  return 0;
}

/* The step the furthest rank got to. */
static uint64_t last_step(const sp_coord *c) {
  uint64_t step = 0;
  for (uint32_t r = 0; r < c->verdict->world; r++)
    if (sp_coord_ranks_step(c, r) > step) step = sp_coord_ranks_step(c, r);
  return step;
}

/* COMPLETED once every rank detached, or under a replica quorum every
 * rank of the groups in it, none of those out of it still attached (a
 * group whose host is gone never comes back to detach); not while the
 * ranks stop for a restart. */
static void maybe_completed(sp_coord *c) {
  struct sp_coord_verdict *v = c->verdict;
  if (v->state != SHARDPLANE__V1__JOB_STATE__JOB_RUNNING ||
      sp_coord_agents_restarting(c) ||
      (sp_coord_ranks_with_status(c, SHARDPLANE__V1__RANK_STATUS__DETACHED) <
           v->world &&
       !sp_coord_quorum_finished(c)))
    return;
  /* once, when the last rank detached */
  uint64_t step = last_step(c);
  v->state = SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  v->end_step = step;
  v->end_ms = sp_coord_base_now_ms(c);
  sp_coord_base_log(c, "job COMPLETED at step %" PRIu64, step);
  sp_coord_event done = {.kind = SP_COORD_EV_COMPLETED, .step = step};
  sp_coord_bus_announce(c, &done);
}

int sp_coord_verdict_detached(sp_coord *c, void *user,
                              const sp_coord_event *e) {
  (void)user;
  (void)e;
  maybe_completed(c);
  return 0;
}

void sp_coord_verdict_restore_completed(sp_coord *c) {
  struct sp_coord_verdict *v = c->verdict;
  uint64_t step = last_step(c);
  v->state = SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED;
  v->end_step = step;
  v->end_ms = sp_coord_base_now_ms(c);
}

int sp_coord_verdict_lost(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  struct sp_coord_verdict *v = c->verdict;
  uint32_t rank = e->rank;
  if (v->has_culprit && v->culprit != rank) {
    v->r[rank].victim = true;
    v->r[rank].victim_of = v->culprit;
    sp_coord_base_log(c, "rank %u lost after rank %u's fault (a victim): %s",
                      rank, v->culprit, e->text);
    snprintf(e->out, e->cap, "%s",
             v->verdict       ? v->verdict
             : v->culprit_msg ? v->culprit_msg
                              : "a peer failed");
    *e->culprit = v->culprit;
    job_failed(c, e->out);
    return 0;
  }
  *e->culprit = rank;
  char msg[SP_DIAG_MAX];
  sp_coord_diag_say(msg, sizeof msg, "rank %u was lost: %s", rank, e->text);
  name_culprit(c, rank, msg);
  sp_coord_diag_open_alert(c, SHARDPLANE__V1__ALERT_KIND__ALERT_LOST, rank, msg,
                           e->evidence_ms);
  snprintf(e->out, e->cap, "%s", msg);
  if (v->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING) job_failed(c, msg);
  if (!c->shutting_down) announce_fault(c, msg);
  return 0;
}

int sp_coord_verdict_session_up(sp_coord *c, void *user,
                                const sp_coord_event *e) {
  (void)user;
  struct sp_coord_verdict *v = c->verdict;
  const Shardplane__V1__SessionUp *q = e->up;
  verdict_rank *k = &v->r[e->rank];
  if (q->has_loss && isfinite(q->loss)) {
    k->has_loss = true;
    k->loss = q->loss;
  }
  if (q->total_steps > v->total_steps) v->total_steps = q->total_steps;
  return 0;
}

int sp_coord_verdict_aborted(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  job_failed(c, e->text);
  return 0;
}

int sp_coord_verdict_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  struct sp_coord_verdict *v = c->verdict;
  maybe_completed(c);
  uint64_t now = e->now_ms;
  uint64_t min_step = UINT64_MAX;
  for (uint32_t r = 0; r < v->world; r++)
    if (sp_coord_ranks_attached(c, r)) {
      uint64_t s = sp_coord_ranks_step(c, r);
      if (s < min_step) min_step = s;
    }
  if (min_step == UINT64_MAX) return 0;
  v->last_min_step = min_step;
  if (v->state != SHARDPLANE__V1__JOB_STATE__JOB_RUNNING) return 0;
  if (v->rate_step0 == 0 && min_step > 0) {
    v->rate_step0 = min_step;
    v->rate_t0_ms = now;
  } else if (min_step > v->rate_step0 && now > v->rate_t0_ms + 500) {
    double rate = (double)(min_step - v->rate_step0) * 1000.0 /
                  (double)(now - v->rate_t0_ms);
    v->steps_per_s =
        v->steps_per_s > 0 ? 0.7 * v->steps_per_s + 0.3 * rate : rate;
    v->rate_step0 = min_step;
    v->rate_t0_ms = now;
  } else if (now > v->rate_t0_ms + 10000 && min_step == v->rate_step0) {
    v->steps_per_s = 0;
  } else if (min_step == v->rate_step0 && now > v->rate_t0_ms) {
    /* no step since rate_t0: the rate now is at most one step over that
     * silence, so a stalled job's rate (and tokens/s) falls at once
     * instead of showing its last speed for 10 s */
    double bound = 1000.0 / (double)(now - v->rate_t0_ms);
    if (v->steps_per_s > bound) v->steps_per_s = bound;
  }
  return 0;
}

int sp_coord_verdict_rank_info(sp_coord *c, void *user,
                               const sp_coord_event *e) {
  (void)user;
  const verdict_rank *k = &c->verdict->r[e->rank];
  e->info->victim = k->victim;
  e->info->victim_of = k->victim_of;
  return 0;
}

/* ---- what GetJob and GetVerdict say ---- */

static double job_loss(const sp_coord *c, bool *has) {
  const struct sp_coord_verdict *v = c->verdict;
  for (uint32_t r = 0; r < v->world; r++)
    if (v->r[r].has_loss) {
      *has = true;
      return v->r[r].loss;
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

static uint64_t silence_limit_ms(const sp_coord_diag_rank *k, float factor,
                                 uint64_t floor_ms, uint64_t thr) {
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
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  /* once: it is a pass over the world itself */
  uint64_t thr = sp_coord_diag_stall_threshold(c);
  bool any = false;
  double worst = 0;
  for (uint32_t r = 0; r < c->verdict->world; r++) {
    if (!sp_coord_ranks_attached(c, r) || !d[r].active) continue;
    uint64_t q = now > d[r].last_event_ms ? now - d[r].last_event_ms : 0;
    uint64_t l = silence_limit_ms(&d[r], factor, floor_ms, thr);
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

void sp_coord_verdict_progress(const sp_coord *c, Shardplane__V1__Progress *p) {
  const struct sp_coord_verdict *v = c->verdict;
  shardplane__v1__progress__init(p);
  p->step = v->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING ||
                    v->state == SHARDPLANE__V1__JOB_STATE__JOB_WAITING
                ? v->last_min_step
                : v->end_step;
  p->total_steps = v->total_steps;
  p->steps_per_s = v->steps_per_s;
  bool has;
  p->loss = job_loss(c, &has);
  p->has_loss = has;
  p->eta_s = v->total_steps > p->step && v->steps_per_s > 0
                 ? (double)(v->total_steps - p->step) / v->steps_per_s
                 : (v->total_steps && v->total_steps <= p->step ? 0 : -1);
}

void sp_coord_verdict_job(sp_coord *c, Shardplane__V1__GetJobResponse *r,
                          Shardplane__V1__Progress *p) {
  struct sp_coord_verdict *v = c->verdict;
  r->state = v->state;
  r->verdict = v->verdict ? v->verdict : (char *)"";
  sp_coord_verdict_progress(c, p);
  r->progress = p;
  uint64_t quiet, limit;
  if (v->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING &&
      most_silent(c, sp_coord_base_now_ms(c), STUCK_FACTOR, STUCK_FLOOR_MS,
                  &quiet, &limit)) {
    r->quiet_ms = quiet;
    r->quiet_limit_ms = limit;
  }
  r->stall_threshold_ms = sp_coord_diag_stall_threshold(c);
}

/* The open alerts, their ages as of now or, once the job ended, as of its
 * end (a rank that exited waits no longer). */
static size_t open_alerts(sp_coord *c, Shardplane__V1__Alert **out,
                          size_t cap) {
  const struct sp_coord_verdict *v = c->verdict;
  uint64_t as_of = ended(v) ? v->end_ms : sp_coord_base_now_ms(c);
  return sp_coord_alerts_list_open(c, as_of, out, cap);
}

void sp_coord_verdict_why(sp_coord *c, sp_coord_why *w) {
  struct sp_coord_verdict *v = c->verdict;
  char *headline = w->headline, *text = w->text;
  size_t hcap = sizeof w->headline, tcap = sizeof w->text;
  w->n_open = open_alerts(c, w->open, SP_COORD_ALERTS_MAX_OPEN);
  size_t n_open = w->n_open;
  Shardplane__V1__Alert **open = w->open;
  uint64_t now = sp_coord_base_now_ms(c), quiet, limit;
  uint32_t n_att = 0;
  for (uint32_t r = 0; r < v->world; r++)
    n_att += sp_coord_ranks_attached(c, r);
  text[0] = '\0';
  if (v->state == SHARDPLANE__V1__JOB_STATE__JOB_FAILED) {
    snprintf(headline, hcap, "failed at step %" PRIu64 ": %s", v->end_step,
             v->verdict ? v->verdict : "");
  } else if (v->state == SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED) {
    snprintf(headline, hcap,
             "completed: all %u ranks finished at step %" PRIu64, v->world,
             v->end_step);
    snprintf(text, tcap, "%s", headline);
    w->healthy = true;
    return;
  } else if (v->state == SHARDPLANE__V1__JOB_STATE__JOB_WAITING) {
    snprintf(headline, hcap, "waiting: %u of %u ranks attached", n_att,
             v->world);
  } else if (n_open == 0 &&
             most_silent(c, now, NOTICE_FACTOR, NOTICE_FLOOR_MS, &quiet,
                         &limit) &&
             quiet > limit) {
    /* well before a stall alert opens, an operator asking `why` of a job
     * that stopped moving must not read "healthy"; not naming the quiet
     * rank: in a collective the waiting ranks fall silent too, and may
     * have done so first; the stall verdict tells them apart */
    snprintf(headline, hcap,
             "no progress for %.0f s: the slowest of the %u ranks is at "
             "step %" PRIu64
             " and one has reported nothing since (a stall alert naming "
             "the culprit opens after %.0f s)",
             (double)quiet / 1e3, v->world, v->last_min_step,
             (double)sp_coord_diag_stall_threshold(c) / 1e3);
  } else if (n_open == 0) {
    bool has;
    double loss = job_loss(c, &has);
    char tail[64] = "";
    if (has) snprintf(tail, sizeof tail, ", loss %.4g", loss);
    snprintf(headline, hcap,
             "healthy: all %u ranks at step %" PRIu64 ", %.1f steps/s%s",
             v->world, v->last_min_step, v->steps_per_s, tail);
  } else {
    snprintf(headline, hcap, "%s", open[n_open - 1]->message);
  }
  size_t used = 0;
  for (size_t i = 0; i < n_open && used + 1 < tcap; i++) {
    const ProtobufCEnumValue *k = protobuf_c_enum_descriptor_get_value(
        &shardplane__v1__alert_kind__descriptor, open[i]->kind);
    int n = snprintf(text + used, tcap - used, "%s%s: %s", used ? "\n" : "",
                     k ? k->name : "?", open[i]->message);
    if (n < 0) break;
    used += (size_t)n < tcap - used ? (size_t)n : tcap - used - 1;
  }
  if (used == 0) snprintf(text, tcap, "%s", headline);
  w->healthy = v->state != SHARDPLANE__V1__JOB_STATE__JOB_FAILED && n_open == 0;
}

bool sp_coord_verdict_victim(const sp_coord *c, uint32_t rank, uint32_t *of) {
  const verdict_rank *k = &c->verdict->r[rank];
  if (k->victim && of != NULL) *of = k->victim_of;
  return k->victim;
}

static void on_get_verdict(sp_rpc_call *call, const ProtobufCMessage *msg,
                           const uint8_t *raw, size_t len) {
  (void)msg;
  (void)raw;
  (void)len;
  sp_coord *c = sp_rpc_call_method_user(call);
  sp_coord_why w;
  sp_coord_verdict_why(c, &w);
  Shardplane__V1__Verdict v = SHARDPLANE__V1__VERDICT__INIT;
  v.healthy = w.healthy;
  v.headline = w.headline;
  v.text = w.text;
  v.n_open_alerts = w.n_open;
  v.open_alerts = w.open;
  Shardplane__V1__GetJobResponse jr = SHARDPLANE__V1__GET_JOB_RESPONSE__INIT;
  Shardplane__V1__Progress p;
  sp_coord_verdict_job(c, &jr, &p);
  v.state = jr.state;
  v.progress = &p;
  v.quorum = sp_coord_quorum_report(c);
  sp_rpc_call_reply(call, &v.base);
  free(v.quorum);
}

static const sp_rpc_method k_methods[] = {
    {SP_COORD_PATH("GetVerdict"), SP_RPC_UNARY,
     &shardplane__v1__get_verdict_request__descriptor, on_get_verdict, NULL,
     NULL, NULL},
};

int sp_coord_verdict_register(sp_coord *c) {
  return sp_coord_base_add_methods(c, k_methods, 1);
}
