/* The dashboard's time series: a sample a second, thinned as it fills. */
#include "coord_history.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "coord_agents.h"
#include "coord_alerts.h"
#include "coord_diag.h"
#include "coord_ranks.h"
#include "coord_verdict.h"

struct sp_coord_history {
  sp_coord_history_sample *s; /* SP_COORD_HISTORY_CAP */
  size_t n;
  uint64_t period_ms;
  /* the last sample was taken after the job ended: no more until it
   * waits or runs again (a new incarnation) */
  bool ended_sampled;
};

int sp_coord_history_init(sp_coord *c) {
  struct sp_coord_history *h = calloc(1, sizeof *h);
  if (h == NULL) return SP_ENOMEM;
  h->s = calloc(SP_COORD_HISTORY_CAP, sizeof *h->s);
  if (h->s == NULL) {
    free(h);
    return SP_ENOMEM;
  }
  h->period_ms = SP_COORD_HISTORY_PERIOD_MS;
  c->history = h;
  return 0;
}

void sp_coord_history_free(sp_coord *c) {
  if (c->history == NULL) return;
  free(c->history->s);
  free(c->history);
  c->history = NULL;
}

size_t sp_coord_history_count(const sp_coord *c) { return c->history->n; }

const sp_coord_history_sample *sp_coord_history_at(const sp_coord *c,
                                                   size_t i) {
  return &c->history->s[i];
}

uint64_t sp_coord_history_period_ms(const sp_coord *c) {
  return c->history->period_ms;
}

/* ---- step time percentiles ---- */

/* Buckets of a float's exponent and top 5 mantissa bits: 32 an octave,
 * each about 2.2 % wide, from 2^-7 ms (8 us) to 2^25 ms (9 hours); times
 * outside go to the end buckets. Integer work on the bits: a pass over
 * 100,000 ranks' windows (1.6 million times) takes a few ms once a
 * second, where sorting them would take a hundred. */
#define PCT_SUB_BITS 5
#define PCT_SHIFT (23 - PCT_SUB_BITS)
#define PCT_LO_EXP 120u /* 2^-7 */
#define PCT_OCTAVES 32u
#define PCT_BUCKETS (PCT_OCTAVES << PCT_SUB_BITS)

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static uint32_t pct_bucket(float ms) {
  uint32_t key = float_bits(ms) >> PCT_SHIFT, lo = PCT_LO_EXP << PCT_SUB_BITS;
  if (key < lo) return 0;
  key -= lo;
  return key < PCT_BUCKETS ? key : PCT_BUCKETS - 1;
}

/* The middle of bucket b. */
static float pct_value(uint32_t b) {
  uint32_t u = ((b + (PCT_LO_EXP << PCT_SUB_BITS)) << PCT_SHIFT) |
               (1u << (PCT_SHIFT - 1));
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* The nearest-rank p-th percentile of the n times counted. */
static float pct_of(const uint32_t *count, uint64_t n, double p) {
  uint64_t want = (uint64_t)ceil(p * (double)n), seen = 0;
  if (want == 0) want = 1;
  for (uint32_t b = 0; b < PCT_BUCKETS; b++) {
    seen += count[b];
    if (seen >= want) return pct_value(b);
  }
  return pct_value(PCT_BUCKETS - 1);
}

void sp_coord_history_step_pcts(const sp_coord *c, float *p50, float *p99) {
  uint32_t count[PCT_BUCKETS] = {0};
  uint64_t n = 0;
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    if (!sp_coord_ranks_attached(c, r)) continue;
    for (uint8_t i = 0; i < d[r].n_steps; i++) {
      float ms = d[r].step_ms[i];
      if (!(ms > 0) || !isfinite(ms)) continue;
      count[pct_bucket(ms)]++;
      n++;
    }
  }
  *p50 = n ? pct_of(count, n, 0.50) : 0;
  *p99 = n ? pct_of(count, n, 0.99) : 0;
}

/* ---- sampling ---- */

static void take_sample(sp_coord *c, uint64_t now, sp_coord_history_sample *s) {
  memset(s, 0, sizeof *s);
  s->t_ms = now;
  Shardplane__V1__GetJobResponse jr = SHARDPLANE__V1__GET_JOB_RESPONSE__INIT;
  Shardplane__V1__Progress p;
  sp_coord_verdict_job(c, &jr, &p);
  s->state = (uint8_t)jr.state;
  s->step = p.step;
  s->loss = p.has_loss ? p.loss : NAN;
  s->steps_per_s = p.steps_per_s;
  uint64_t tokens = 0;
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    if (!sp_coord_ranks_attached(c, r)) continue;
    sp_coord_rank_view v;
    sp_coord_ranks_get(c, r, &v);
    tokens += v.tokens_per_step;
    s->attached++;
  }
  s->tokens_per_s = p.steps_per_s * (double)tokens;
  sp_coord_history_step_pcts(c, &s->step_p50_ms, &s->step_p99_ms);
  Shardplane__V1__Alert *open[SP_COORD_ALERTS_MAX_OPEN];
  s->open_alerts = (uint32_t)sp_coord_alerts_list_open(
      c, now, open, SP_COORD_ALERTS_MAX_OPEN);
  uint32_t restarts;
  sp_coord_agents_incarnation(c, &s->incarnation, &restarts);
}

/* Full: every other sample goes (the newest stays), and the period
 * doubles, so the spacing stays even. */
static void thin(struct sp_coord_history *h) {
  size_t keep = h->n / 2;
  for (size_t i = 0; i < keep; i++) h->s[i] = h->s[h->n - 2 * keep + 2 * i + 1];
  h->n = keep;
  h->period_ms *= 2;
}

int sp_coord_history_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  struct sp_coord_history *h = c->history;
  Shardplane__V1__JobState st = sp_coord_verdict_state(c);
  bool live = st == SHARDPLANE__V1__JOB_STATE__JOB_WAITING ||
              st == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING;
  if (!live && h->ended_sampled) return 0;
  /* the end is sampled at once: the chart ends where the job did */
  if (live && h->n > 0 && e->now_ms < h->s[h->n - 1].t_ms + h->period_ms)
    return 0;
  if (h->n == SP_COORD_HISTORY_CAP) {
    thin(h);
    /* due again at the new period, for an even spacing */
    if (live && e->now_ms < h->s[h->n - 1].t_ms + h->period_ms) return 0;
  }
  take_sample(c, e->now_ms, &h->s[h->n++]);
  h->ended_sampled = !live;
  return 0;
}
