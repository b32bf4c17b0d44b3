/* Per communicator a ring of the first fingerprint seen at each recent
 * seq, and the tie a mismatch may leave open. */
#include "coord_desync.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_alerts.h"
#include "coord_verdict.h"

/* Fingerprints a communicator remembers: more than a rank can be ahead of
 * its slowest peer (FSDP's in-flight limit is a handful). */
#define COMM_SLOTS 64u
/* How long a tied desync waits for a member to break the tie (well within
 * the second the verdict is due in). */
#define DESYNC_TIE_MS 400u

typedef struct comm_slot {
  sp_coord_diag_fprint f;
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
  sp_coord_diag_fprint pending_f;
} comm_table;

struct sp_coord_desync {
  comm_table world_t, *shard_t, *replica_t;
};

/* The tables of one incarnation, for the job's communicators. */
static int desync_alloc(sp_coord *c, struct sp_coord_desync *s) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  if (t->n_kinds == 1) return 0;
  s->shard_t = calloc(t->n_shard, sizeof *s->shard_t);
  s->replica_t = calloc(t->n_replica, sizeof *s->replica_t);
  return s->shard_t == NULL || s->replica_t == NULL ? SP_ENOMEM : 0;
}

static void desync_clear(sp_coord *c, struct sp_coord_desync *s) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  free(s->world_t.slots);
  for (uint32_t i = 0; s->shard_t && i < t->n_shard; i++)
    free(s->shard_t[i].slots);
  for (uint32_t i = 0; s->replica_t && i < t->n_replica; i++)
    free(s->replica_t[i].slots);
  free(s->shard_t);
  free(s->replica_t);
  memset(s, 0, sizeof *s);
}

int sp_coord_desync_init(sp_coord *c) {
  c->desync = calloc(1, sizeof *c->desync);
  if (c->desync == NULL) return SP_ENOMEM;
  return desync_alloc(c, c->desync);
}

void sp_coord_desync_free(sp_coord *c) {
  if (c->desync == NULL) return;
  desync_clear(c, c->desync);
  free(c->desync);
  c->desync = NULL;
}

int sp_coord_desync_new_incarnation(sp_coord *c, void *user,
                                    const sp_coord_event *e) {
  (void)user;
  (void)e;
  desync_clear(c, c->desync);
  return desync_alloc(c, c->desync);
}

static comm_table *table_of(struct sp_coord_desync *s,
                            const sp_coord_diag_topo *t, int kind,
                            uint32_t index) {
  switch (kind) {
    case SHARDPLANE__V1__COMM_KIND__COMM_WORLD:
      return index == 0 ? &s->world_t : NULL;
    case SHARDPLANE__V1__COMM_KIND__COMM_SHARD:
      return s->shard_t && index < t->n_shard ? &s->shard_t[index] : NULL;
    case SHARDPLANE__V1__COMM_KIND__COMM_REPLICA:
      return s->replica_t && index < t->n_replica ? &s->replica_t[index] : NULL;
    default: return NULL;
  }
}

bool sp_coord_desync_first(const sp_coord *c, int kind, uint32_t index,
                           uint64_t seq, sp_coord_diag_fprint *f) {
  const comm_table *t =
      table_of(c->desync, sp_coord_diag_topology(c), kind, index);
  if (t == NULL || t->slots == NULL || t->slots[seq % COMM_SLOTS].f.seq != seq)
    return false;
  *f = t->slots[seq % COMM_SLOTS].f;
  return true;
}

static bool fp_eq(const sp_coord_diag_fprint *a,
                  const sp_coord_diag_fprint *b) {
  return a->op == b->op && a->unit == b->unit && a->dtype == b->dtype &&
         a->count == b->count;
}

/* How many ranks of the other groups of `kind` issued fingerprint ref at
 * f's seq, less how many issued f. */
static int other_groups_vote(const sp_coord *c, int kind, uint32_t index,
                             const sp_coord_diag_fprint *ref,
                             const sp_coord_diag_fprint *f) {
  if (kind == SHARDPLANE__V1__COMM_KIND__COMM_WORLD) return 0;
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *r = sp_coord_diag_ranks(c);
  uint32_t groups =
      kind == SHARDPLANE__V1__COMM_KIND__COMM_SHARD ? t->n_shard : t->n_replica;
  int vote = 0;
  for (uint32_t g = 0; g < groups; g++) {
    if (g == index) continue;
    for (uint32_t i = 0; i < sp_coord_diag_n_members(t, kind); i++) {
      const sp_coord_diag_fprint *x = &r[sp_coord_diag_member(t, kind, g, i)]
                                           .comm[kind]
                                           .ring[f->seq % SP_DIAG_RANK_RING];
      if (x->seq != f->seq) continue;
      vote += fp_eq(x, ref) ? 1 : fp_eq(x, f) ? -1 : 0;
    }
  }
  return vote;
}

/* Raises the DESYNC alert, unless the sides are tied with members still
 * to be heard from and force is false; whether it did. Its evidence: the
 * mismatch, seen at evidence_ms. */
static bool desync_alert(sp_coord *c, int kind, uint32_t index,
                         const comm_slot *ref, uint32_t rank,
                         const sp_coord_diag_fprint *f, bool force,
                         uint64_t evidence_ms) {
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  const sp_coord_diag_rank *rr = sp_coord_diag_ranks(c);
  uint32_t nm = sp_coord_diag_n_members(t, kind);
  uint32_t *a = calloc((size_t)nm * 3 + 1, sizeof *a);
  if (a == NULL) return true; /* cannot tell: do not try again */
  uint32_t *b = a + nm, *none = b + nm;
  size_t na = 0, nb = 0, nn = 0;
  for (uint32_t i = 0; i < nm; i++) {
    uint32_t r = sp_coord_diag_member(t, kind, index, i);
    const sp_coord_diag_fprint *x =
        &rr[r].comm[kind].ring[f->seq % SP_DIAG_RANK_RING];
    if (x->seq != f->seq)
      none[nn++] = r;
    else if (fp_eq(x, &ref->f))
      a[na++] = r;
    else
      b[nb++] = r;
  }
  /* a tie inside a shard or replica group: the other groups of its kind
   * run the same program and say which fingerprint belongs at this seq */
  int vote = na == nb ? other_groups_vote(c, kind, index, &ref->f, f) : 0;
  if (!force && na == nb && vote == 0 &&
      (nn > 0 || kind != SHARDPLANE__V1__COMM_KIND__COMM_WORLD)) {
    free(a);
    return false;
  }
  char la[1200], lb[1200], ln[1200] = "", wa[200], wb[200], ea[160], eb[160],
                           comm[48];
  sp_coord_diag_fmt_ranks(a, na, la, sizeof la);
  sp_coord_diag_fmt_ranks(b, nb, lb, sizeof lb);
  if (nn) sp_coord_diag_fmt_ranks(none, nn, ln, sizeof ln);
  sp_coord_diag_fp_words(c, &ref->f, wa, sizeof wa);
  sp_coord_diag_fp_words(c, f, wb, sizeof wb);
  sp_coord_diag_last_event(c, na ? a[0] : ref->first_rank, ea, sizeof ea);
  sp_coord_diag_last_event(c, nb ? b[0] : rank, eb, sizeof eb);
  sp_coord_diag_comm_label(kind, index, comm, sizeof comm);
  char msg[SP_DIAG_MAX];
  sp_coord_diag_say(msg, sizeof msg,
                    "desync on %s at collective #%" PRIu64
                    ": %s issued %s (last event: %s); %s issued %s (last "
                    "event: %s)%s%s%s",
                    comm, f->seq, la, wa, ea, lb, wb, eb, nn ? "; " : "", ln,
                    nn == 0   ? ""
                    : nn == 1 ? " has not issued it yet"
                              : " have not issued it yet");
  /* the smaller side is the odd one out; at a tie, the one the other
   * groups disagree with, else the later one */
  bool b_culprit = na != nb ? nb < na : vote >= 0;
  Shardplane__V1__Collective col;
  sp_coord_diag_collective_msg(&col, b_culprit ? f : &ref->f, kind, index);
  sp_coord_alerts_info in = {.kind = SHARDPLANE__V1__ALERT_KIND__DESYNC,
                             .culprits = b_culprit ? b : a,
                             .n_culprits = b_culprit ? nb : na,
                             .victims = b_culprit ? a : b,
                             .n_victims = b_culprit ? na : nb,
                             .collective = &col,
                             .evidence_ms = evidence_ms};
  sp_coord_alerts_open(c, &in, msg);
  sp_coord_verdict_fault(c, msg, true, b_culprit ? b[0] : a[0], false);
  free(a);
  return true;
}

int sp_coord_desync_collective(sp_coord *c, void *user,
                               const sp_coord_event *e) {
  (void)user;
  const Shardplane__V1__Collective *q = e->collective;
  uint32_t rank = e->rank;
  if (!sp_coord_diag_counts(c, rank, q) || q->completed) return 0;
  int kind = (int)q->comm;
  comm_table *t =
      table_of(c->desync, sp_coord_diag_topology(c), kind, q->comm_index);
  sp_coord_diag_fprint f = {.seq = q->seq,
                            .count = q->count,
                            .unit = q->unit,
                            .op = (uint8_t)q->op,
                            .dtype = (uint8_t)q->dtype};
  if (t->slots == NULL) {
    t->slots = calloc(COMM_SLOTS, sizeof *t->slots);
    if (t->slots == NULL) return 0;
  }
  comm_slot *s = &t->slots[q->seq % COMM_SLOTS];
  if (s->f.seq < q->seq) {
    s->f = f;
    s->first_rank = rank;
  } else if (s->f.seq == q->seq && !t->desynced) {
    if (!fp_eq(&s->f, &f) && !t->pending) {
      t->pending = true;
      t->pending_ms = e->now_ms;
      t->pending_rank = rank;
      t->pending_f = f;
    }
    /* every fingerprint at the pending seq may break a tie */
    if (t->pending && t->pending_f.seq == q->seq &&
        desync_alert(c, kind, q->comm_index, s, t->pending_rank, &t->pending_f,
                     false, t->pending_ms)) {
      t->desynced = true;
      t->pending = false;
    }
  }
  return 0;
}

/* A tie still unbroken after DESYNC_TIE_MS: the verdict goes out by the
 * tie rule rather than late. */
static void settle_tie(sp_coord *c, int kind, uint32_t index, uint64_t now) {
  comm_table *t = table_of(c->desync, sp_coord_diag_topology(c), kind, index);
  if (t == NULL || !t->pending || t->desynced ||
      now - t->pending_ms < DESYNC_TIE_MS)
    return;
  t->pending = false;
  const comm_slot *s = &t->slots[t->pending_f.seq % COMM_SLOTS];
  if (s->f.seq != t->pending_f.seq) return; /* long gone */
  t->desynced = desync_alert(c, kind, index, s, t->pending_rank, &t->pending_f,
                             true, t->pending_ms);
}

int sp_coord_desync_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  const sp_coord_diag_topo *t = sp_coord_diag_topology(c);
  settle_tie(c, SHARDPLANE__V1__COMM_KIND__COMM_WORLD, 0, e->now_ms);
  for (uint32_t i = 0; i < t->n_shard; i++)
    settle_tie(c, SHARDPLANE__V1__COMM_KIND__COMM_SHARD, i, e->now_ms);
  for (uint32_t i = 0; i < t->n_replica; i++)
    settle_tie(c, SHARDPLANE__V1__COMM_KIND__COMM_REPLICA, i, e->now_ms);
  return 0;
}
