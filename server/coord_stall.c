/* The stall detector: a job whose ranks still heartbeat but no longer
 * move, explained by the collective they wait in and who has not issued
 * it (or, in none, by the silent ranks themselves). */
#include "coord_stall.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_desync.h"
#include "coord_diag.h"
#include "coord_quorum.h"
#include "coord_ranks.h"
#include "coord_verdict.h"

struct sp_coord_stall {
  bool open; /* a STALL alert is open: the rest follows from it */
};

int sp_coord_stall_init(sp_coord *c) {
  c->stall = calloc(1, sizeof *c->stall);
  return c->stall != NULL ? 0 : SP_ENOMEM;
}

void sp_coord_stall_free(sp_coord *c) {
  free(c->stall);
  c->stall = NULL;
}

int sp_coord_stall_new_incarnation(sp_coord *c, void *user,
                                   const sp_coord_event *e) {
  (void)user;
  (void)e;
  c->stall->open = false;
  return 0;
}

static bool in_collective(const sp_coord_diag_topo *t,
                          const sp_coord_diag_rank *k) {
  for (int kind = 0; kind < t->n_kinds; kind++)
    if (k->comm[kind].issued.seq > k->comm[kind].done_seq) return true;
  return false;
}

/* Whether the open collective (kind, index, f) has members that have not
 * issued it and wait in no collective themselves: the end of the chain of
 * waits (ranks 0-1 wait in the world for rank 2, which waits in its shard
 * group for rank 3, which is in none: rank 3 is the one to name). */
static bool waits_on_a_root(const sp_coord *c, int kind, uint32_t index,
                            const sp_coord_diag_fprint *f) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  bool any = false;
  for (uint32_t i = 0; i < sp_coord_diag_n_members(t, kind); i++) {
    uint32_t r = sp_coord_diag_member(t, kind, index, i);
    const sp_coord_diag_rank *k = &d[r];
    if (k->comm[kind].issued.seq >= f->seq) continue;
    if (sp_coord_ranks_status(c, r) ==
        SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED)
      continue;
    if (sp_coord_ranks_attached(c, r) && in_collective(t, k)) return false;
    any = true;
  }
  return any;
}

/* The collective to explain the stall by: the earliest-issued open one
 * whose missing members wait on nothing, else the earliest-issued open
 * one. */
static bool find_waited(const sp_coord *c, int *kind_out, uint32_t *index_out,
                        sp_coord_diag_fprint *f_out) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  bool found = false, rooted = false;
  uint64_t oldest = UINT64_MAX;
  for (uint32_t r = 0; r < t->world; r++) {
    if (!sp_coord_ranks_attached(c, r)) continue;
    const sp_coord_diag_rank *k = &d[r];
    for (int kind = 0; kind < t->n_kinds; kind++) {
      if (k->comm[kind].issued.seq == 0 ||
          k->comm[kind].done_seq >= k->comm[kind].issued.seq)
        continue;
      bool root =
          waits_on_a_root(c, kind, k->comm[kind].index, &k->comm[kind].issued);
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
                         const sp_coord_diag_fprint *fp, uint64_t now,
                         uint32_t *waiting, size_t *nw_out, uint32_t *missing,
                         size_t *nmiss_out) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  size_t nw = 0, nmiss = 0;
  uint64_t since = now;
  for (uint32_t i = 0; i < sp_coord_diag_n_members(t, kind); i++) {
    uint32_t r = sp_coord_diag_member(t, kind, index, i);
    const sp_coord_diag_rank *k = &d[r];
    if (!sp_coord_ranks_attached(c, r)) {
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

/* Opens the STALL alert, its text tmpl aged from since (msg rendered now),
 * and hands the verdict on, naming the first culprit when there is one. */
static void raise_stall(sp_coord *c, const uint32_t *cul, size_t nc,
                        const uint32_t *vic, size_t nv,
                        const Shardplane__V1__Collective *col, const char *msg,
                        const char *tmpl, uint64_t since,
                        uint64_t evidence_ms) {
  sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__STALL,
                             .culprits = cul,
                             .n_culprits = nc,
                             .victims = vic,
                             .n_victims = nv,
                             .collective = col,
                             .tmpl = tmpl,
                             .since_ms = since,
                             .evidence_ms = evidence_ms};
  sp_coord_alerts_open(c, &in, msg);
  sp_coord_verdict_fault(c, msg, nc > 0, nc > 0 ? cul[0] : 0, true);
}

/* The verdict on a stall; evidence_ms: when the first of the silent ranks
 * fell silent. */
static void stall_verdict(sp_coord *c, uint64_t now, uint64_t thr,
                          uint64_t evidence_ms) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  uint32_t *waiting = malloc((size_t)t->world * 2 * sizeof *waiting);
  if (waiting == NULL) return;
  uint32_t *missing = waiting + t->world;
  size_t nw = 0, nmiss = 0;
  int kind = 0;
  uint32_t index = 0;
  sp_coord_diag_fprint f = {0};
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
    for (uint32_t i = 0; i < sp_coord_diag_n_members(t, kind); i++) {
      uint32_t r = sp_coord_diag_member(t, kind, index, i);
      if (sp_coord_ranks_status(c, r) ==
          SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED)
        continue;
      uint64_t q = d[r].comm[kind].issued.seq;
      if (q < lo) lo = q;
      if (q > hi) hi = q;
    }
    if (lo < hi && lo + 1 != f.seq &&
        sp_coord_desync_first(c, kind, index, lo + 1, &f))
      since = classify(c, kind, index, &f, now, waiting, &nw, missing, &nmiss);
    if (since == now) since = now - thr;
    double secs = (double)(now - since) / 1000.0;
    /* the seconds are rendered as of each reading
     * (sp_coord_alerts_list_open) */
    sp_coord_diag_comm_label(kind, index, comm, sizeof comm);
    sp_coord_diag_fmt_ranks(waiting, nw, lw, sizeof lw);
    Shardplane__V1__Collective col;
    sp_coord_diag_collective_msg(&col, &f, kind, index);
    if (nmiss > 0) {
      sp_coord_diag_fmt_ranks(missing, nmiss, lm, sizeof lm);
      sp_coord_diag_last_event(c, missing[0], ev, sizeof ev);
      int st = sp_coord_ranks_status(c, missing[0]);
      const char *then =
          st == SHARDPLANE__V1__RANK_STATUS__DETACHED ? " (then it detached)"
          : st == SHARDPLANE__V1__RANK_STATUS__LOST   ? " (then it was lost)"
                                                      : "";
      sp_coord_diag_say(
          tmpl, sizeof tmpl,
          "%s %s not issued %s #%" PRIu64
          " of unit %u (%s) on %s; %s %s "
          "been waiting in it for %s s; rank %u's last event: %s%s",
          lm, nmiss == 1 ? "has" : "have", sp_coord_diag_op_name(f.op), f.seq,
          f.unit, sp_coord_diag_unit_name(c, f.unit), comm, lw,
          nw == 1 ? "has" : "have", SP_COORD_ALERTS_AGE, missing[0], ev, then);
      sp_coord_alerts_render_age(tmpl, secs, msg, sizeof msg);
      raise_stall(c, missing, nmiss, waiting, nw, &col, msg, tmpl, since,
                  evidence_ms);
    } else {
      sp_coord_diag_fp_words(c, &f, words, sizeof words);
      sp_coord_diag_say(tmpl, sizeof tmpl,
                        "every member of %s (%s) issued %s, collective "
                        "#%" PRIu64
                        ", and none has completed it for %s s: the network "
                        "or the collective library, not a rank",
                        comm, lw, words, f.seq, SP_COORD_ALERTS_AGE);
      sp_coord_alerts_render_age(tmpl, secs, msg, sizeof msg);
      raise_stall(c, NULL, 0, waiting, nw, &col, msg, tmpl, since, evidence_ms);
    }
  } else {
    /* nobody in a collective: the silent ranks themselves */
    for (uint32_t r = 0; r < t->world; r++)
      if (sp_coord_ranks_attached(c, r) && d[r].active &&
          now - d[r].last_event_ms > thr)
        missing[nmiss++] = r;
    if (nmiss == 0) {
      free(waiting);
      return;
    }
    sp_coord_diag_fmt_ranks(missing, nmiss, lm, sizeof lm);
    sp_coord_diag_last_event(c, missing[0], ev, sizeof ev);
    uint64_t since = d[missing[0]].last_event_ms;
    sp_coord_diag_say(tmpl, sizeof tmpl,
                      "%s made no progress for %s s while heartbeating, in "
                      "no collective; rank %u's last event: %s",
                      lm, SP_COORD_ALERTS_AGE, missing[0], ev);
    sp_coord_alerts_render_age(tmpl, (double)(now - since) / 1000.0, msg,
                               sizeof msg);
    nw = sp_coord_diag_others(c, missing, nmiss, waiting);
    raise_stall(c, missing, nmiss, waiting, nw, NULL, msg, tmpl, since,
                evidence_ms);
  }
  free(waiting);
}

int sp_coord_stall_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  uint64_t now = e->now_ms;
  struct sp_coord_stall *s = c->stall;
  if (sp_coord_verdict_state(c) != SHARDPLANE__V1__JOB_STATE__JOB_RUNNING)
    return 0;
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *d = sp_coord_diag_ranks(c);
  uint64_t thr = sp_coord_diag_stall_threshold(c);
  bool any = false, moving = false;
  /* the stall's evidence: the silence of the first rank that fell silent */
  uint64_t silent_since = now;
  for (uint32_t r = 0; r < t->world; r++) {
    if (!sp_coord_ranks_attached(c, r) || !d[r].active ||
        sp_coord_quorum_settling(c, r))
      continue;
    if (now - d[r].last_event_ms > thr) {
      any = true;
      if (d[r].last_event_ms < silent_since) silent_since = d[r].last_event_ms;
    } else if (now - d[r].last_event_ms < SP_DIAG_TICK_MS * 2) {
      moving = true;
    }
  }
  if (!any) {
    if (s->open) {
      s->open = false;
      sp_coord_alerts_close(c, SHARDPLANE__V1__ALERT_KIND__STALL, true, 0);
      sp_coord_base_log(c, "the stall is over: every rank moves again");
    }
    return 0;
  }
  (void)moving;
  if (s->open) return 0;
  s->open = true;
  stall_verdict(c, now, thr, silent_since);
  return 0;
}
