/* The straggler detector: each rank's own time per step (the step less
 * its waits on its peers) against the job's median of them. */
#include "coord_straggler.h"

#include <stdlib.h>
#include <string.h>

#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_diag.h"
#include "coord_ranks.h"

/* What the detector keeps of one rank. */
typedef struct straggler_rank {
  /* the rank's step when it first crossed the straggler bar (0: it has
   * not): one slow window is not a straggler, a slow stretch is */
  uint64_t over_since;
  uint64_t over_since_ms; /* and when (coordinator clock): its evidence */
  float score; /* its own time over the job's median, as last judged */
  bool straggling;
} straggler_rank;

struct sp_coord_straggler {
  uint32_t world;
  straggler_rank *r;
  /* the median of the ranks' own step times, from the last tick (0: not
   * yet known), that each rank's step close is judged against */
  float job_med;
};

static int straggler_alloc(sp_coord *c, struct sp_coord_straggler *s) {
  s->world = c->plan->world_size;
  s->r = calloc(s->world, sizeof *s->r);
  return s->r != NULL ? 0 : SP_ENOMEM;
}

int sp_coord_straggler_init(sp_coord *c) {
  c->straggler = calloc(1, sizeof *c->straggler);
  if (c->straggler == NULL) return SP_ENOMEM;
  return straggler_alloc(c, c->straggler);
}

void sp_coord_straggler_free(sp_coord *c) {
  if (c->straggler == NULL) return;
  free(c->straggler->r);
  free(c->straggler);
  c->straggler = NULL;
}

int sp_coord_straggler_new_incarnation(sp_coord *c, void *user,
                                       const sp_coord_event *e) {
  (void)user;
  (void)e;
  struct sp_coord_straggler *s = c->straggler;
  free(s->r);
  memset(s, 0, sizeof *s);
  return straggler_alloc(c, s);
}

/* The median of v[0..n) (n > 0), reordering v. */
static float select_median(float *v, size_t n) {
  float hi = sp_coord_diag_select(v, n, n / 2);
  if (n % 2) return hi;
  /* the other middle one: the largest of the lower half */
  float lo = v[0];
  for (size_t i = 1; i < n / 2; i++)
    if (v[i] > lo) lo = v[i];
  return (lo + hi) / 2;
}

/* Judged at each of the rank's step closes (once the message that closed
 * it was read: SP_COORD_EV_STEP), against the job's median of
 * the last tick, so that the 4 steps it must stay over the bar are steps,
 * not ticks: judged on the 200 ms tick alone, a job of 20 ms steps moved
 * 10 steps between judgements and a 1.5x slow rank was flagged at step
 * 25 instead of 14 on a loaded machine. */
static void judge_straggler(sp_coord *c, uint32_t r) {
  struct sp_coord_straggler *s = c->straggler;
  const sp_coord_diag_rank *k = &sp_coord_diag_ranks(c)[r];
  straggler_rank *g = &s->r[r];
  float job_med = s->job_med;
  if (job_med <= 0 || !sp_coord_ranks_attached(c, r) ||
      k->n_steps < SP_DIAG_STEP_WINDOW / 2)
    return;
  double ratio =
      c->cfg.diag.straggler_ratio > 1.0 ? c->cfg.diag.straggler_ratio : 1.3;
  /* a floor of 1 ms keeps near-zero compute from making ratios */
  float base = job_med > 1.0f ? job_med : 1.0f;
  g->score = k->busy_med / base;
  float step = sp_coord_diag_median(k->step_ms, k->n_steps);
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
    g->over_since = 0;
  else if (g->over_since == 0) {
    g->over_since = k->cur_step + 1;
    g->over_since_ms = sp_coord_base_now_ms(c);
  }
  if (!g->straggling && over &&
      k->cur_step + 1 >= g->over_since + SP_DIAG_STRAGGLER_STEPS) {
    g->straggling = true;
    char msg[SP_DIAG_MAX];
    sp_coord_diag_say(
        msg, sizeof msg,
        "rank %u is a straggler: its own time (the step less its "
        "waits on peers) is %.2fx the job's median%s, %.1f ms a step "
        "against %.1f ms over its last %u steps (%.1f ms or more in "
        "three steps of four); each step takes %.1f ms, and the "
        "other ranks spend about %.1f ms of it waiting for rank %u "
        "in collectives",
        r, (double)g->score, job_med < base ? " (taken as 1 ms at least)" : "",
        (double)k->busy_med, (double)job_med, (unsigned)k->n_steps,
        (double)k->busy_lo, (double)step, (double)excess, r);
    sp_coord_diag_open_alert(c, SHARDPLANE__V1__ALERT_KIND__STRAGGLER, r, msg,
                             g->over_since_ms);
  } else if (g->straggling && g->score < (ratio + 1.0) / 2) {
    g->straggling = false;
    sp_coord_alerts_close(c, SHARDPLANE__V1__ALERT_KIND__STRAGGLER, false, r);
  }
}

int sp_coord_straggler_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  (void)e;
  struct sp_coord_straggler *s = c->straggler;
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  float *meds = malloc((size_t)s->world * sizeof *meds);
  if (meds == NULL) return 0;
  size_t n = 0;
  for (uint32_t r = 0; r < s->world; r++)
    if (sp_coord_ranks_attached(c, r) &&
        d[r].n_steps >= SP_DIAG_STEP_WINDOW / 2)
      meds[n++] = d[r].busy_med;
  if (n < 2) {
    free(meds);
    s->job_med = 0;
    return 0;
  }
  /* the median of the medians, every tick: linear in the world */
  s->job_med = select_median(meds, n);
  free(meds);
  for (uint32_t r = 0; r < s->world; r++) judge_straggler(c, r);
  return 0;
}

int sp_coord_straggler_step(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  judge_straggler(c, e->rank);
  return 0;
}

int sp_coord_straggler_attached(sp_coord *c, void *user,
                                const sp_coord_event *e) {
  (void)user;
  memset(&c->straggler->r[e->rank], 0, sizeof c->straggler->r[0]);
  return 0;
}

float sp_coord_straggler_score(const sp_coord *c, uint32_t rank) {
  const sp_coord_diag_rank *k = &sp_coord_diag_ranks(c)[rank];
  return k->n_steps ? c->straggler->r[rank].score : 0;
}

int sp_coord_straggler_rank_info(sp_coord *c, void *user,
                                 const sp_coord_event *e) {
  (void)user;
  e->info->straggler_score = sp_coord_straggler_score(c, e->rank);
  return 0;
}
