/* The /metrics exposition, built at each scrape from the areas' state,
 * and the few figures gathered from the bus that no area keeps. The
 * families come in the order of docs/observability.md: the job, the
 * ranks, the steps and collectives, the diagnosis, the control plane. */
#include "coord_metrics.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord_agents.h"
#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_diag.h"
#include "coord_http.h"
#include "coord_ranks.h"
#include "coord_straggler.h"
#include "coord_verdict.h"
#include "plan/job.h"
#include "plan/state.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Bucket bounds, seconds. Steps: a few ms (a small model on a GPU) to
 * minutes (GPT-2 on a CPU). Diagnosis: a desync is named within the
 * message that shows it, a tie within DESYNC_TIE_MS, a loss after the
 * heartbeat timeout (5 s), a stall after its threshold (10 s at least),
 * a straggler after SP_DIAG_STRAGGLER_STEPS steps. */
static const double k_step_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                       0.1,   0.25,   0.5,   1,    2.5,   5,
                                       10,    30,     60,    120,  300};
static const double k_delay_bounds[] = {0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,  10,
                                        15,   20,  30,   60,  120, 300, 600};
#define MAX_BOUNDS 17
_Static_assert(COUNT(k_step_bounds) <= MAX_BOUNDS &&
                   COUNT(k_delay_bounds) <= MAX_BOUNDS,
               "a histogram's buckets hold its bounds");

/* A histogram of fixed bounds: per bucket (not cumulative; the last one
 * over the last bound), how many, and their sum. */
typedef struct histo {
  uint64_t bucket[MAX_BOUNDS + 1];
  uint64_t count;
  double sum;
} histo;

/* Alert kinds as the label says them; the detectors' first (their
 * verdicts' delays are measured). */
enum { K_DESYNC, K_STALL, K_STRAGGLER, K_LOST, K_ILLEGAL, K_OTHER, N_KINDS };
#define N_DETECTED (K_LOST + 1)
static const char *const k_kind_label[N_KINDS] = {
    "desync", "stall", "straggler", "lost", "illegal_transition", "other"};

struct sp_coord_metrics {
  histo step;               /* every rank's every closed step */
  histo delay[N_DETECTED];  /* evidence to verdict, by kind */
  uint64_t raised[N_KINDS]; /* alerts raised since this process began */
  uint64_t last_step;       /* the job's step as of the last tick */
  double last_step_unix;    /* when it last advanced; 0: not yet */
};

int sp_coord_metrics_init(sp_coord *c) {
  c->metrics = calloc(1, sizeof *c->metrics);
  return c->metrics != NULL ? 0 : SP_ENOMEM;
}

void sp_coord_metrics_free(sp_coord *c) {
  free(c->metrics);
  c->metrics = NULL;
}

static void observe(histo *h, const double *bounds, size_t nb, double v) {
  size_t i = 0;
  while (i < nb && v > bounds[i]) i++;
  h->bucket[i]++;
  h->count++;
  h->sum += v;
}

static int kind_index(Shardplane__V1__AlertKind k) {
  switch (k) {
    case SHARDPLANE__V1__ALERT_KIND__DESYNC: return K_DESYNC;
    case SHARDPLANE__V1__ALERT_KIND__STALL: return K_STALL;
    case SHARDPLANE__V1__ALERT_KIND__STRAGGLER: return K_STRAGGLER;
    case SHARDPLANE__V1__ALERT_KIND__ALERT_LOST: return K_LOST;
    case SHARDPLANE__V1__ALERT_KIND__ILLEGAL_TRANSITION: return K_ILLEGAL;
    default: return K_OTHER;
  }
}

static double unix_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- the bus ---- */

int sp_coord_metrics_step(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  const sp_coord_diag_rank *k = &sp_coord_diag_ranks(c)[e->rank];
  /* the newest entries of the window are the steps the message closed */
  uint32_t n = e->n_closed < k->n_steps ? e->n_closed : k->n_steps;
  for (uint32_t i = 1; i <= n; i++) {
    size_t s = (k->next + SP_DIAG_STEP_WINDOW - i) % SP_DIAG_STEP_WINDOW;
    observe(&c->metrics->step, k_step_bounds, COUNT(k_step_bounds),
            (double)k->step_ms[s] / 1000.0);
  }
  return 0;
}

int sp_coord_metrics_alert(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  struct sp_coord_metrics *m = c->metrics;
  int k = kind_index(e->alert->kind);
  m->raised[k]++;
  if (k < N_DETECTED) {
    uint64_t at = e->alert->time_ms;
    double secs =
        at > e->evidence_ms ? (double)(at - e->evidence_ms) / 1000.0 : 0;
    observe(&m->delay[k], k_delay_bounds, COUNT(k_delay_bounds), secs);
  }
  return 0;
}

int sp_coord_metrics_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  (void)e;
  struct sp_coord_metrics *m = c->metrics;
  Shardplane__V1__Progress p;
  sp_coord_verdict_progress(c, &p);
  /* a new incarnation counts from 0 again: not an advance */
  if (p.step > m->last_step) m->last_step_unix = unix_now();
  m->last_step = p.step;
  return 0;
}

/* ---- writing the text ---- */

static void head(sp_textbuf *b, const char *name, const char *type,
                 const char *help) {
  sp_textbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value as the format quotes it: backslash, quote and newline
 * escaped. */
static void put_label(sp_textbuf *b, const char *s) {
  const char *run = s;
  for (; *s; s++) {
    const char *esc = *s == '\\'   ? "\\\\"
                      : *s == '"'  ? "\\\""
                      : *s == '\n' ? "\\n"
                                   : NULL;
    if (esc == NULL) continue;
    sp_textbuf_put(b, run, (size_t)(s - run));
    sp_textbuf_puts(b, esc);
    run = s + 1;
  }
  sp_textbuf_put(b, run, (size_t)(s - run));
}

/* A float as the format writes it: NaN, +Inf, -Inf, or 15 significant
 * digits (what a double keeps exactly in decimal). */
static void put_value(sp_textbuf *b, double v) {
  if (isnan(v))
    sp_textbuf_puts(b, "NaN");
  else if (isinf(v))
    sp_textbuf_puts(b, v > 0 ? "+Inf" : "-Inf");
  else
    sp_textbuf_printf(b, "%.15g", v);
}

/* "name{labels} v\n"; labels NULL or "" for none. */
static void sample(sp_textbuf *b, const char *name, const char *labels,
                   double v) {
  if (labels != NULL && labels[0] != '\0')
    sp_textbuf_printf(b, "%s{%s} ", name, labels);
  else
    sp_textbuf_printf(b, "%s ", name);
  put_value(b, v);
  sp_textbuf_put(b, "\n", 1);
}

static void sample_u64(sp_textbuf *b, const char *name, const char *labels,
                       uint64_t v) {
  if (labels != NULL && labels[0] != '\0')
    sp_textbuf_printf(b, "%s{%s} %" PRIu64 "\n", name, labels, v);
  else
    sp_textbuf_printf(b, "%s %" PRIu64 "\n", name, v);
}

/* One metric of a family: HELP, TYPE and its one unlabelled sample. */
static void gauge(sp_textbuf *b, const char *name, const char *help, double v) {
  head(b, name, "gauge", help);
  sample(b, name, NULL, v);
}

static void gauge_u64(sp_textbuf *b, const char *name, const char *help,
                      uint64_t v) {
  head(b, name, "gauge", help);
  sample_u64(b, name, NULL, v);
}

static void counter_u64(sp_textbuf *b, const char *name, const char *help,
                        uint64_t v) {
  head(b, name, "counter", help);
  sample_u64(b, name, NULL, v);
}

/* A histogram's samples (the family's head written before): cumulative
 * buckets, +Inf, sum and count, each with labels (NULL: none) before
 * le. */
static void put_histo(sp_textbuf *b, const char *name, const char *labels,
                      const uint64_t *bucket, size_t nb, const double *bounds,
                      uint64_t count, double sum) {
  const char *sep = labels != NULL && labels[0] ? "," : "";
  if (labels == NULL) labels = "";
  uint64_t cum = 0;
  for (size_t i = 0; i < nb; i++) {
    cum += bucket[i];
    sp_textbuf_printf(b, "%s_bucket{%s%sle=\"%g\"} %" PRIu64 "\n", name, labels,
                      sep, bounds[i], cum);
  }
  sp_textbuf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %" PRIu64 "\n", name, labels,
                    sep, count);
  char sname[96];
  snprintf(sname, sizeof sname, "%s_sum", name);
  sample(b, sname, labels, sum);
  snprintf(sname, sizeof sname, "%s_count", name);
  sample_u64(b, sname, labels, count);
}

/* ---- what one pass over the ranks gathers ---- */

typedef struct rank_totals {
  uint32_t by_root[SP_ROOT_SUMMON_FULL_PARAMS + 1]; /* attached ranks */
  uint64_t tokens_per_step;                         /* attached ranks' */
  uint64_t heard_max_ms, mem_max;                   /* attached ranks' */
  double peak_over_predicted; /* < 0: no rank reported both */
  float straggler_max;        /* attached ranks' */
  size_t n_step_times;        /* their recent step times */
} rank_totals;

static void gather(sp_coord *c, uint64_t now, rank_totals *t) {
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  memset(t, 0, sizeof *t);
  t->peak_over_predicted = -1;
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    sp_coord_rank_view v;
    sp_coord_ranks_get(c, r, &v);
    if (v.mem_peak_bytes && v.mem_predicted_bytes) {
      double x = (double)v.mem_peak_bytes / (double)v.mem_predicted_bytes;
      if (x > t->peak_over_predicted) t->peak_over_predicted = x;
    }
    if (v.status != SHARDPLANE__V1__RANK_STATUS__ATTACHED) continue;
    if (v.root >= 0 && (size_t)v.root < COUNT(t->by_root)) t->by_root[v.root]++;
    t->tokens_per_step += v.tokens_per_step;
    uint64_t age = now > v.last_heard_ms ? now - v.last_heard_ms : 0;
    if (age > t->heard_max_ms) t->heard_max_ms = age;
    if (v.mem_bytes > t->mem_max) t->mem_max = v.mem_bytes;
    float s = sp_coord_straggler_score(c, r);
    if (s > t->straggler_max) t->straggler_max = s;
    t->n_step_times += d[r].n_steps;
  }
}

/* ---- the job ---- */

static void render_job(sp_coord *c, sp_textbuf *b, uint64_t now,
                       const rank_totals *t) {
  const sp_plan *pl = c->plan;
  head(b, "shardplane_job_info", "gauge",
       "The job: its model, plan version and effective sharding strategy "
       "(always 1)");
  sp_textbuf_puts(b, "shardplane_job_info{model=\"");
  put_label(b, c->model->name ? c->model->name : "");
  sp_textbuf_puts(b, "\",plan_version=\"");
  put_label(b, pl->version_hex);
  sp_textbuf_puts(b, "\",strategy=\"");
  put_label(b, sp_strategy_name(pl->strategy));
  sp_textbuf_puts(b, "\"} 1\n");

  static const struct {
    Shardplane__V1__JobState s;
    const char *label;
  } states[] = {{SHARDPLANE__V1__JOB_STATE__JOB_WAITING, "waiting"},
                {SHARDPLANE__V1__JOB_STATE__JOB_RUNNING, "running"},
                {SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED, "completed"},
                {SHARDPLANE__V1__JOB_STATE__JOB_FAILED, "failed"}};
  Shardplane__V1__JobState state = sp_coord_verdict_state(c);
  head(b, "shardplane_job_state", "gauge",
       "The job's state: 1 for the current one (waiting until every rank "
       "attached, running, completed once every rank detached, failed with "
       "the first verdict), 0 for the others");
  for (size_t i = 0; i < COUNT(states); i++)
    sp_textbuf_printf(b, "shardplane_job_state{state=\"%s\"} %d\n",
                      states[i].label, states[i].s == state);

  uint64_t inc;
  uint32_t restarts;
  sp_coord_agents_incarnation(c, &inc, &restarts);
  gauge_u64(b, "shardplane_job_incarnation",
            "The job's incarnation (one start of its workers), from 0", inc);
  counter_u64(b, "shardplane_job_restarts_total",
              "Restarts of the job's workers (new incarnations) since the "
              "job began",
              restarts);
  gauge_u64(b, "shardplane_job_world_size", "Ranks in the job", pl->world_size);

  Shardplane__V1__Progress p;
  sp_coord_verdict_progress(c, &p);
  gauge_u64(b, "shardplane_job_step",
            "The job's step: the slowest attached rank's (at the end, the "
            "step it ended at)",
            p.step);
  gauge_u64(b, "shardplane_job_total_steps",
            "The steps the job will take in all, as the trainers report it "
            "(0: unknown)",
            p.total_steps);
  gauge(b, "shardplane_job_steps_per_second",
        "The job's steps per second (smoothed; 0 while it does not advance)",
        p.steps_per_s);
  gauge(b, "shardplane_job_tokens_per_second",
        "Tokens (samples, for a model without a sequence) the job consumes "
        "per second: its steps per second times the tokens per step the "
        "attached ranks report",
        p.steps_per_s * (double)t->tokens_per_step);
  head(b, "shardplane_job_loss", "gauge",
       "The last training loss a rank reported (absent until one is)");
  if (p.has_loss) sample(b, "shardplane_job_loss", NULL, p.loss);
  head(b, "shardplane_job_last_step_timestamp_seconds", "gauge",
       "Unix time when the job's step last advanced (absent until it "
       "does)");
  if (c->metrics->last_step_unix > 0)
    sample(b, "shardplane_job_last_step_timestamp_seconds", NULL,
           c->metrics->last_step_unix);
  head(b, "shardplane_job_eta_seconds", "gauge",
       "Estimated seconds until the job's last step (absent while "
       "unknown)");
  if (p.eta_s >= 0) sample(b, "shardplane_job_eta_seconds", NULL, p.eta_s);
  gauge(b, "shardplane_job_uptime_seconds",
        "Seconds since the coordinator started", (double)now / 1000.0);
}

/* ---- the ranks ---- */

static void render_rank_counts(sp_coord *c, sp_textbuf *b,
                               const rank_totals *t) {
  static const struct {
    int status;
    const char *label;
  } st[] = {{SHARDPLANE__V1__RANK_STATUS__ATTACHED, "attached"},
            {SHARDPLANE__V1__RANK_STATUS__LOST, "lost"},
            {SHARDPLANE__V1__RANK_STATUS__DETACHED, "detached"},
            {SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED, "never_attached"}};
  head(b, "shardplane_ranks", "gauge", "Ranks by status");
  for (size_t i = 0; i < COUNT(st); i++)
    sp_textbuf_printf(b, "shardplane_ranks{status=\"%s\"} %u\n", st[i].label,
                      sp_coord_ranks_with_status(c, st[i].status));
  head(b, "shardplane_ranks_by_state", "gauge",
       "Attached ranks by the state of their root (FSDP TrainingState)");
  for (int s = SP_ROOT_IDLE; s <= SP_ROOT_SUMMON_FULL_PARAMS; s++)
    sp_textbuf_printf(b, "shardplane_ranks_by_state{state=\"%s\"} %u\n",
                      sp_state_name(SP_MACHINE_ROOT, s), t->by_root[s]);
}

/* The per-rank families: one loop over the world each (a family's
 * samples must be together). */
enum {
  PR_STEP,
  PR_STATE,
  PR_STATUS,
  PR_HEARD,
  PR_MEM,
  PR_PEAK,
  PR_PREDICTED,
  PR_TOKENS,
  PR_STRAGGLER,
  PR_N
};
static const struct {
  const char *name, *help;
} k_per_rank[PR_N] = {
    {"shardplane_rank_step", "The rank's step"},
    {"shardplane_rank_state",
     "The state of the rank's root: 1 IDLE, 2 FORWARD_BACKWARD, "
     "3 SUMMON_FULL_PARAMS"},
    {"shardplane_rank_status",
     "The rank's status: 0 never attached, 1 attached, 2 lost, "
     "3 detached"},
    {"shardplane_rank_last_heard_seconds",
     "Seconds since the rank was last heard from (absent for a rank never "
     "attached)"},
    {"shardplane_rank_memory_bytes",
     "The memory the rank reported in use (resident bytes on a CPU, "
     "allocated device bytes on a GPU; absent until reported)"},
    {"shardplane_rank_memory_peak_bytes",
     "The most memory the rank reported using (absent until reported)"},
    {"shardplane_rank_memory_predicted_bytes",
     "The memory model's prediction of the rank's peak, as the rank "
     "reported it (absent until reported)"},
    {"shardplane_rank_tokens_per_step",
     "Tokens (samples) the rank consumes per optimizer step, as it "
     "reported (absent until reported)"},
    {"shardplane_rank_straggler_score",
     "The rank's median own time per step (less its waits on peers) over "
     "the job's median, as ListRanks gives it (0 before its first step)"},
};

static void render_per_rank(sp_coord *c, sp_textbuf *b, uint64_t now) {
  uint32_t w = c->plan->world_size;
  for (int f = 0; f < PR_N; f++) {
    const char *name = k_per_rank[f].name;
    head(b, name, "gauge", k_per_rank[f].help);
    for (uint32_t r = 0; r < w; r++) {
      sp_coord_rank_view v;
      sp_coord_ranks_get(c, r, &v);
      uint64_t x = 0;
      switch (f) {
        case PR_STEP: x = v.step; break;
        case PR_STATE: x = (uint64_t)v.root; break;
        case PR_STATUS: x = (uint64_t)v.status; break;
        case PR_HEARD:
          if (v.status == SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED) continue;
          sp_textbuf_printf(b, "%s{rank=\"%u\"} ", name, r);
          put_value(b, now > v.last_heard_ms
                           ? (double)(now - v.last_heard_ms) / 1000.0
                           : 0);
          sp_textbuf_put(b, "\n", 1);
          continue;
        case PR_MEM: x = v.mem_bytes; break;
        case PR_PEAK: x = v.mem_peak_bytes; break;
        case PR_PREDICTED: x = v.mem_predicted_bytes; break;
        case PR_TOKENS: x = v.tokens_per_step; break;
        default:
          sp_textbuf_printf(b, "%s{rank=\"%u\"} ", name, r);
          put_value(b, sp_coord_straggler_score(c, r));
          sp_textbuf_put(b, "\n", 1);
          continue;
      }
      /* a figure the trainer never reported is no figure at all */
      if (x == 0 && f >= PR_MEM) continue;
      sp_textbuf_printf(b, "%s{rank=\"%u\"} %" PRIu64 "\n", name, r, x);
    }
  }
}

static void render_rank_aggregates(sp_textbuf *b, const rank_totals *t,
                                   bool per_rank) {
  gauge(b, "shardplane_rank_last_heard_seconds_max",
        "Seconds since the attached rank heard from longest ago was last "
        "heard from (0: none attached)",
        (double)t->heard_max_ms / 1000.0);
  gauge_u64(b, "shardplane_rank_memory_bytes_max",
            "The most memory in use any attached rank reported (0: none)",
            t->mem_max);
  head(b, "shardplane_rank_memory_peak_over_predicted_max", "gauge",
       "The largest ratio of a rank's reported peak memory to its predicted "
       "peak, over the ranks that reported both (absent while none has)");
  if (t->peak_over_predicted >= 0)
    sample(b, "shardplane_rank_memory_peak_over_predicted_max", NULL,
           t->peak_over_predicted);
  gauge(b, "shardplane_straggler_score_max",
        "The highest straggler score of the attached ranks (0: none scored)",
        t->straggler_max);
  gauge_u64(b, "shardplane_metrics_per_rank",
            "Whether the per-rank series (shardplane_rank_*{rank}) are "
            "exposed: 1 while the world is within the rank limit "
            "(--metrics-rank-limit), else 0",
            per_rank);
}

/* ---- steps and collectives ---- */

/* The quantiles of every attached rank's recent step times together (the
 * diagnosis record's windows), by the record's own definition
 * (sp_coord_diag_pct: the smallest with at least q of them at or under
 * it). */
static void render_steps(sp_coord *c, sp_textbuf *b, const rank_totals *t) {
  struct sp_coord_metrics *m = c->metrics;
  head(b, "shardplane_step_duration_seconds", "histogram",
       "Duration of every closed step of every rank (the worker's clock, "
       "from one step's start to the next's)");
  put_histo(b, "shardplane_step_duration_seconds", NULL, m->step.bucket,
            COUNT(k_step_bounds), k_step_bounds, m->step.count, m->step.sum);
  /* a summary of quantiles alone: the window slides, so a _sum and a
   * _count of it would not be the counters they are taken for (the
   * histogram above has those) */
  head(b, "shardplane_step_time_seconds", "summary",
       "Quantiles of the attached ranks' recent step times together (the "
       "last 16 steps of each; absent before the first)");
  if (t->n_step_times == 0) return;
  float *v = malloc(t->n_step_times * sizeof *v);
  if (v == NULL) {
    b->err = b->err ? b->err : SP_ENOMEM;
    return;
  }
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  size_t n = 0;
  for (uint32_t r = 0; r < c->plan->world_size && n < t->n_step_times; r++) {
    if (!sp_coord_ranks_attached(c, r)) continue;
    size_t k = d[r].n_steps;
    if (k > t->n_step_times - n) k = t->n_step_times - n;
    memcpy(v + n, d[r].step_ms, k * sizeof *v);
    n += k;
  }
  static const struct {
    double q;
    const char *label;
  } qs[] = {{0.5, "0.5"}, {0.9, "0.9"}, {0.99, "0.99"}};
  for (size_t i = 0; i < COUNT(qs) && n > 0; i++) {
    size_t k = (size_t)ceil(qs[i].q * (double)n) - 1;
    if (k >= n) k = n - 1;
    float x = sp_coord_diag_select(v, n, k);
    sp_textbuf_printf(b, "shardplane_step_time_seconds{quantile=\"%s\"} ",
                      qs[i].label);
    put_value(b, (double)x / 1000.0);
    sp_textbuf_put(b, "\n", 1);
  }
  free(v);
}

static const char *const k_comm_label[SP_DIAG_KINDS] = {"world", "shard",
                                                        "replica"};

/* Issued seq lag per communicator: the highest seq its attached members
 * issued less the lowest. Per communicator while there are at most
 * `limit` of them, the largest of each kind always. */
static void render_collectives(sp_coord *c, sp_textbuf *b, uint32_t limit) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  uint64_t n_comms = 1;
  if (t->n_kinds > 1) n_comms += (uint64_t)t->n_shard + t->n_replica;
  bool each = n_comms <= limit;
  uint64_t lag_max[SP_DIAG_KINDS] = {0};
  head(b, "shardplane_collective_seq_lag", "gauge",
       "Per communicator, the highest collective seq its attached members "
       "issued less the lowest (absent above the rank limit's number of "
       "communicators)");
  for (int kind = 0; kind < t->n_kinds; kind++) {
    uint32_t groups = kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD ? t->n_shard
                      : kind == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA
                          ? t->n_replica
                          : 1;
    uint32_t nm = sp_coord_diag_n_members(t, kind);
    for (uint32_t g = 0; g < groups; g++) {
      uint64_t lo = UINT64_MAX, hi = 0;
      for (uint32_t i = 0; i < nm; i++) {
        uint32_t r = sp_coord_diag_member(t, kind, g, i);
        if (!sp_coord_ranks_attached(c, r)) continue;
        uint64_t s = d[r].comm[kind].issued.seq;
        if (s < lo) lo = s;
        if (s > hi) hi = s;
      }
      uint64_t lag = lo == UINT64_MAX ? 0 : hi - lo;
      if (lag > lag_max[kind]) lag_max[kind] = lag;
      if (each)
        sp_textbuf_printf(b,
                          "shardplane_collective_seq_lag{comm=\"%s\","
                          "index=\"%u\"} %" PRIu64 "\n",
                          k_comm_label[kind], g, lag);
    }
  }
  head(b, "shardplane_collective_seq_lag_max", "gauge",
       "The largest shardplane_collective_seq_lag of each kind of "
       "communicator");
  for (int kind = 0; kind < t->n_kinds; kind++)
    sp_textbuf_printf(
        b, "shardplane_collective_seq_lag_max{comm=\"%s\"} %" PRIu64 "\n",
        k_comm_label[kind], lag_max[kind]);
}

/* ---- the diagnosis ---- */

static void render_diagnosis(sp_coord *c, sp_textbuf *b, uint64_t now) {
  struct sp_coord_metrics *m = c->metrics;
  Shardplane__V1__Alert *open[SP_COORD_ALERTS_MAX_OPEN];
  size_t n = sp_coord_alerts_list_open(c, now, open, COUNT(open));
  uint64_t by_kind[N_KINDS] = {0};
  for (size_t i = 0; i < n; i++) by_kind[kind_index(open[i]->kind)]++;
  head(b, "shardplane_alerts_open", "gauge",
       "Alerts open now by kind (a detector's, until it closes it)");
  for (int k = 0; k < K_OTHER; k++)
    sp_textbuf_printf(b, "shardplane_alerts_open{kind=\"%s\"} %" PRIu64 "\n",
                      k_kind_label[k], by_kind[k]);
  head(b, "shardplane_alerts_raised_total", "counter",
       "Alerts raised by kind since this coordinator process started "
       "(other: an operator's abort)");
  for (int k = 0; k < N_KINDS; k++)
    sp_textbuf_printf(
        b, "shardplane_alerts_raised_total{kind=\"%s\"} %" PRIu64 "\n",
        k_kind_label[k], m->raised[k]);
  counter_u64(b, "shardplane_alerts_total",
              "Alerts raised since the job began, across the coordinator's "
              "restarts on a state dir",
              sp_coord_alerts_total(c));
  head(b, "shardplane_diagnosis_delay_seconds", "histogram",
       "Time from a fault's evidence to the detector's verdict, by kind "
       "(desync: the differing fingerprint; stall: the first silent rank's "
       "last event; straggler: its first step over the bar; lost: when it "
       "was last heard, or its stream broke)");
  for (int k = 0; k < N_DETECTED; k++) {
    char labels[32];
    snprintf(labels, sizeof labels, "kind=\"%s\"", k_kind_label[k]);
    put_histo(b, "shardplane_diagnosis_delay_seconds", labels,
              m->delay[k].bucket, COUNT(k_delay_bounds), k_delay_bounds,
              m->delay[k].count, m->delay[k].sum);
  }
}

/* ---- the control plane ---- */

/* "/pkg.Service/Method": the service and the method's short name. */
static void split_path(const char *path, const char **svc, int *svc_len,
                       const char **method) {
  const char *s = path[0] == '/' ? path + 1 : path;
  const char *slash = strrchr(s, '/');
  *svc = s;
  *svc_len = slash ? (int)(slash - s) : 0;
  *method = slash ? slash + 1 : s;
}

static void render_rpc(sp_coord *c, sp_textbuf *b) {
  sp_rpc_method_stats ms;
  head(b, "shardplane_rpc_calls_total", "counter",
       "gRPC calls ended, by service, method and status code");
  for (size_t i = 0; sp_rpc_server_method_stats(c->srv, i, &ms) == 0; i++) {
    const char *svc, *method;
    int sl;
    split_path(ms.path, &svc, &sl, &method);
    for (int code = 0; code < SP_RPC_CODES; code++) {
      if (ms.calls[code] == 0) continue;
      sp_textbuf_printf(b,
                        "shardplane_rpc_calls_total{service=\"%.*s\","
                        "method=\"%s\",code=\"%s\"} %" PRIu64 "\n",
                        sl, svc, method, sp_rpc_code_name(code),
                        ms.calls[code]);
    }
  }
  head(b, "shardplane_rpc_duration_seconds", "histogram",
       "Duration of the gRPC calls ended, from their request headers to "
       "their status (a stream's whole life), by service and method");
  for (size_t i = 0; sp_rpc_server_method_stats(c->srv, i, &ms) == 0; i++) {
    if (ms.count == 0) continue;
    const char *svc, *method;
    int sl;
    split_path(ms.path, &svc, &sl, &method);
    char labels[160];
    snprintf(labels, sizeof labels, "service=\"%.*s\",method=\"%s\"", sl, svc,
             method);
    put_histo(b, "shardplane_rpc_duration_seconds", labels, ms.bucket,
              SP_RPC_DURATION_BUCKETS, sp_rpc_duration_bounds, ms.count,
              ms.sum_s);
  }
  sp_rpc_server_stats st;
  sp_rpc_server_get_stats(c->srv, &st);
  gauge_u64(b, "shardplane_rpc_connections_open", "gRPC connections open now",
            st.connections_open);
  gauge_u64(b, "shardplane_rpc_streams_open",
            "gRPC calls open now (every rank's Session stream among them)",
            st.calls_open);
  gauge_u64(b, "shardplane_rpc_buffered_bytes",
            "Request and response bytes the gRPC server holds buffered now",
            st.buffered_bytes);
  counter_u64(b, "shardplane_rpc_connections_refused_total",
              "gRPC connections refused with every connection slot busy",
              st.connections_refused);
  counter_u64(b, "shardplane_rpc_calls_refused_total",
              "gRPC calls refused by authorization (a bad or missing token, "
              "a role without the right)",
              st.calls_refused);
  counter_u64(b, "shardplane_rpc_bytes_received_total",
              "Bytes of gRPC request bodies received", st.bytes_in);
  counter_u64(b, "shardplane_rpc_bytes_sent_total",
              "Bytes the gRPC server sent (frames of every kind)",
              st.bytes_out);
}

static void render_control(sp_coord *c, sp_textbuf *b) {
  render_rpc(c, b);
  sp_kvstore_stats ks;
  sp_kvstore_get_stats(c->store, &ks);
  gauge_u64(b, "shardplane_store_keys", "Keys in the coordinator's store",
            ks.keys);
  gauge_u64(b, "shardplane_store_bytes",
            "Key and value bytes in the coordinator's store", ks.bytes);
  gauge_u64(b, "shardplane_store_waiters",
            "Store waits registered and not yet woken", ks.waiters);
  gauge(b, "shardplane_loop_pause_max_seconds",
        "The longest pause of the coordinator's event loop (its heartbeat "
        "check firing late)",
        (double)c->loop_pause_max_ms / 1000.0);
  head(b, "shardplane_loop_pause_seconds_total", "counter",
       "The coordinator's event loop pauses added up");
  sample(b, "shardplane_loop_pause_seconds_total", NULL,
         (double)c->loop_pause_total_ms / 1000.0);
  sp_coord_http_stats hs;
  sp_coord_http_get_stats(c, &hs);
  gauge_u64(b, "shardplane_http_connections_open",
            "HTTP connections open now (0 without --http-listen)",
            hs.connections_open);
  counter_u64(b, "shardplane_http_requests_total", "HTTP requests answered",
              hs.requests_total);
  counter_u64(b, "shardplane_http_unauthorized_total",
              "HTTP requests answered 401 or 403", hs.unauthorized_total);
  counter_u64(b, "shardplane_http_response_bytes_total",
              "HTTP response body bytes sent", hs.bytes_out);
}

int sp_coord_metrics_render(sp_coord *c, sp_textbuf *out) {
  uint64_t now = sp_coord_base_now_ms(c);
  uint32_t limit = c->cfg.metrics_rank_limit ? c->cfg.metrics_rank_limit
                                             : SP_COORD_METRICS_RANK_LIMIT;
  bool per_rank = c->plan->world_size <= limit;
  rank_totals t;
  gather(c, now, &t);
  /* about 50 B a per-rank sample, and 16 kB for the rest; never more
   * than the buffer's bound allows, which is for the text, not a guess */
  size_t guess =
      (per_rank ? (size_t)c->plan->world_size * PR_N * 50 : 0) + (16u << 10);
  if (out->max && guess > out->max - (out->len < out->max ? out->len : 0))
    guess = out->max > out->len ? out->max - out->len : 0;
  sp_textbuf_reserve(out, guess);
  render_job(c, out, now, &t);
  render_rank_counts(c, out, &t);
  if (per_rank) render_per_rank(c, out, now);
  render_rank_aggregates(out, &t, per_rank);
  render_steps(c, out, &t);
  render_collectives(c, out, limit);
  render_diagnosis(c, out, now);
  render_control(c, out);
  return out->err;
}

int sp_coord_metrics_route(sp_coord *c, const char *path,
                           const sp_coord_http_query *q,
                           sp_coord_http_resp *r) {
  (void)path;
  (void)q;
  sp_textbuf b;
  sp_textbuf_init(&b, 0);
  int rc = sp_coord_metrics_render(c, &b);
  if (rc != 0) {
    sp_textbuf_free(&b);
    return rc;
  }
  r->content_type = SP_COORD_METRICS_CONTENT_TYPE;
  return sp_textbuf_take(&b, &r->body, &r->len);
}
