/* The first divergence of every communicator in a coordinator's dump
 * (analyze.h). The dump is untrusted: every field is checked for type and
 * range before use, and an error names the origin and the JSON path.
 *
 * A collective is named by (communicator, seq); every member issues the same
 * seq with the same fingerprint (op, unit, dtype, count). Walking each
 * communicator's seqs in order, the first one where the members disagree,
 * where some issued and others did not, or where not all finished, is where
 * the job went wrong: everything after it is a consequence. */
#include "analyze.h"

#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/json.h"
#include "flight_fmt.h"

#define MAX_COMMS 65536

typedef struct comm_id {
  char name[16];
  uint32_t index;
} comm_id;

/* One rank's view of one collective: its issue and completion merged. */
typedef struct coll_rec {
  uint32_t comm, rank;
  uint64_t seq;
  const char *op, *dtype, *fqn;
  uint32_t unit;
  uint64_t count, step;
  bool issued, completed;
  uint64_t issue_us, done_us;
} coll_rec;

typedef struct rank_in {
  uint32_t rank;
  json_t *flight;    /* NULL: did not answer */
  const char *error; /* flight_error */
  const char *status, *root_state;
  long long step;
  json_t *last; /* its latest event, NULL none */
} rank_in;

typedef struct ctx {
  sp_json_reader jr;
  comm_id *comms;
  size_t n_comms;
  coll_rec *recs;
  size_t n_recs, cap_recs;
  rank_in *ranks;
  size_t n_ranks;
  uint64_t taken_us;
  const char *const *unit_fqns;
  size_t n_units;
} ctx;

static int comm_of(ctx *c, const char *name, uint32_t index, const char *path,
                   uint32_t *out) {
  if (strcmp(name, "world") != 0 && strcmp(name, "shard") != 0 &&
      strcmp(name, "replica") != 0)
    return sp_json_fail(&c->jr, SP_EFORMAT,
                        "%s.comm: \"%s\" is not world, shard or replica", path,
                        name);
  for (size_t i = 0; i < c->n_comms; i++)
    if (c->comms[i].index == index && strcmp(c->comms[i].name, name) == 0) {
      *out = (uint32_t)i;
      return 0;
    }
  if (c->n_comms == MAX_COMMS)
    return sp_json_fail(&c->jr, SP_ETOOBIG, "%s: more than %d communicators",
                        path, MAX_COMMS);
  if (c->n_comms % 64 == 0) {
    comm_id *n = realloc(c->comms, (c->n_comms + 64) * sizeof *n);
    if (n == NULL) return SP_ENOMEM;
    c->comms = n;
  }
  snprintf(c->comms[c->n_comms].name, sizeof c->comms[0].name, "%s", name);
  c->comms[c->n_comms].index = index;
  *out = (uint32_t)c->n_comms++;
  return 0;
}

static const char *event_fqn(ctx *c, json_t *ev, const char *path) {
  const char *fqn = NULL;
  /* the coordinator may name the unit's module; older dumps do not */
  if (sp_json_string(&c->jr, ev, "fqn", path, false, &fqn) != 0) return NULL;
  if (fqn != NULL) return fqn;
  json_t *u = json_object_get(ev, "unit");
  if (json_is_integer(u) && json_integer_value(u) >= 0 &&
      (size_t)json_integer_value(u) < c->n_units)
    return c->unit_fqns[json_integer_value(u)];
  return NULL;
}

/* An event's fields, checked, as flight_fmt reads them. */
static int read_event(ctx *c, json_t *ev, const char *path,
                      sp_flight_event *e) {
  memset(e, 0, sizeof *e);
  e->after_us = -1;
  if (!json_is_object(ev))
    return sp_json_fail(&c->jr, SP_EFORMAT, "%s: expected an object", path);
  const char *type;
  long long v;
  int rc = sp_json_string(&c->jr, ev, "type", path, true, &type);
  if (rc == 0)
    rc = sp_json_int(&c->jr, ev, "t_us", path, true, 0, LLONG_MAX, &v);
  if (rc != 0) return rc;
  e->t_us = (uint64_t)v;
  v = 0;
  if ((rc = sp_json_int(&c->jr, ev, "step", path, false, 0, LLONG_MAX, &v)))
    return rc;
  e->step = (uint64_t)v;
  v = 0;
  if ((rc = sp_json_int(&c->jr, ev, "unit", path, false, 0, UINT32_MAX, &v)))
    return rc;
  e->unit = (uint32_t)v;
  e->fqn = event_fqn(c, ev, path);
  if (strcmp(type, "transition") == 0) {
    rc = sp_json_string(&c->jr, ev, "machine", path, true, &e->machine);
    if (rc == 0)
      rc = sp_json_string(&c->jr, ev, "state", path, true, &e->state);
    return rc;
  }
  if (strcmp(type, "collective") != 0)
    return sp_json_fail(&c->jr, SP_EFORMAT,
                        "%s.type: \"%s\" is not collective or transition", path,
                        type);
  e->collective = true;
  rc = sp_json_string(&c->jr, ev, "comm", path, true, &e->comm);
  v = 0;
  if (rc == 0)
    rc = sp_json_int(&c->jr, ev, "comm_index", path, false, 0, UINT32_MAX, &v);
  e->comm_index = (uint32_t)v;
  if (rc == 0)
    rc = sp_json_int(&c->jr, ev, "seq", path, true, 0, LLONG_MAX, &v);
  e->seq = (uint64_t)v;
  if (rc == 0) rc = sp_json_string(&c->jr, ev, "op", path, true, &e->op);
  if (rc == 0) rc = sp_json_string(&c->jr, ev, "dtype", path, true, &e->dtype);
  if (rc == 0)
    rc = sp_json_int(&c->jr, ev, "count", path, true, 0, LLONG_MAX, &v);
  e->count = (uint64_t)v;
  if (rc == 0)
    rc = sp_json_bool(&c->jr, ev, "completed", path, false, &e->completed);
  return rc;
}

static int add_rec(ctx *c, uint32_t rank, const sp_flight_event *e,
                   const char *path) {
  uint32_t comm = 0;
  int rc = comm_of(c, e->comm, e->comm_index, path, &comm);
  if (rc != 0) return rc;
  if (c->n_recs == c->cap_recs) {
    size_t cap = c->cap_recs ? c->cap_recs * 2 : 256;
    coll_rec *n = realloc(c->recs, cap * sizeof *n);
    if (n == NULL) return SP_ENOMEM;
    c->recs = n;
    c->cap_recs = cap;
  }
  c->recs[c->n_recs++] = (coll_rec){.comm = comm,
                                    .rank = rank,
                                    .seq = e->seq,
                                    .op = e->op,
                                    .dtype = e->dtype,
                                    .fqn = e->fqn,
                                    .unit = e->unit,
                                    .count = e->count,
                                    .step = e->step,
                                    .issued = !e->completed,
                                    .completed = e->completed,
                                    .issue_us = e->completed ? 0 : e->t_us,
                                    .done_us = e->completed ? e->t_us : 0};
  return 0;
}

static int read_rank(ctx *c, json_t *o, size_t i, rank_in *k) {
  char path[64];
  snprintf(path, sizeof path, "ranks[%zu]", i);
  if (!json_is_object(o))
    return sp_json_fail(&c->jr, SP_EFORMAT, "%s: expected an object", path);
  long long v;
  int rc = sp_json_int(&c->jr, o, "rank", path, true, 0, UINT32_MAX, &v);
  if (rc != 0) return rc;
  k->rank = (uint32_t)v;
  k->step = -1;
  if ((rc = sp_json_string(&c->jr, o, "status", path, false, &k->status)) ||
      (rc = sp_json_string(&c->jr, o, "root_state", path, false,
                           &k->root_state)) ||
      (rc = sp_json_int(&c->jr, o, "step", path, false, 0, LLONG_MAX,
                        &k->step)) ||
      (rc = sp_json_string(&c->jr, o, "flight_error", path, false, &k->error)))
    return rc;
  json_t *f = json_object_get(o, "flight");
  if (f == NULL || json_is_null(f)) return 0;
  char fpath[80];
  snprintf(fpath, sizeof fpath, "%s.flight", path);
  if (!json_is_object(f))
    return sp_json_fail(&c->jr, SP_EFORMAT, "%s: expected an object or null",
                        fpath);
  json_t *evs;
  rc =
      sp_json_array(&c->jr, f, "events", fpath, true, SP_DUMP_MAX_EVENTS, &evs);
  if (rc != 0) return rc;
  k->flight = f;
  uint64_t last_t = 0;
  for (size_t j = 0; j < json_array_size(evs); j++) {
    char epath[112];
    snprintf(epath, sizeof epath, "%s.events[%zu]", fpath, j);
    sp_flight_event e;
    json_t *ev = json_array_get(evs, j);
    if ((rc = read_event(c, ev, epath, &e)) != 0) return rc;
    if (e.collective && (rc = add_rec(c, k->rank, &e, epath)) != 0) return rc;
    if (k->last == NULL || e.t_us >= last_t) {
      k->last = ev;
      last_t = e.t_us;
    }
  }
  return 0;
}

static int rec_cmp(const void *pa, const void *pb) {
  const coll_rec *a = pa, *b = pb;
  if (a->comm != b->comm) return a->comm < b->comm ? -1 : 1;
  if (a->seq != b->seq) return a->seq < b->seq ? -1 : 1;
  if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
  return (int)a->completed - (int)b->completed; /* the issue first */
}

/* One record per (comm, seq, rank): a completion joins its issue. */
static void merge_recs(ctx *c) {
  qsort(c->recs, c->n_recs, sizeof *c->recs, rec_cmp);
  size_t w = 0;
  for (size_t i = 0; i < c->n_recs; i++) {
    coll_rec *r = &c->recs[i];
    if (w > 0) {
      coll_rec *p = &c->recs[w - 1];
      if (p->comm == r->comm && p->seq == r->seq && p->rank == r->rank) {
        if (r->completed) {
          p->completed = true;
          p->done_us = r->done_us;
        }
        if (r->issued && !p->issued) {
          p->issued = true;
          p->issue_us = r->issue_us;
        }
        continue;
      }
    }
    c->recs[w++] = *r;
  }
  c->n_recs = w;
}

static const coll_rec *find_rec(const ctx *c, uint32_t comm, uint64_t seq,
                                uint32_t rank) {
  coll_rec key = {.comm = comm, .seq = seq, .rank = rank};
  size_t lo = 0, hi = c->n_recs;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    coll_rec k2 = c->recs[mid];
    k2.completed = false;
    int d = rec_cmp(&key, &k2);
    if (d == 0) return &c->recs[mid];
    if (d < 0)
      hi = mid;
    else
      lo = mid + 1;
  }
  return NULL;
}

static void rec_event(const ctx *c, const coll_rec *r, sp_flight_event *e) {
  memset(e, 0, sizeof *e);
  e->collective = true;
  e->comm = c->comms[r->comm].name;
  e->comm_index = c->comms[r->comm].index;
  e->seq = r->seq;
  e->op = r->op;
  e->dtype = r->dtype;
  e->fqn = r->fqn;
  e->unit = r->unit;
  e->count = r->count;
  e->step = r->step;
  e->completed = r->completed;
  e->t_us = r->completed ? r->done_us : r->issue_us;
  e->after_us = r->completed && r->issued && r->done_us >= r->issue_us
                    ? (int64_t)(r->done_us - r->issue_us)
                    : -1;
}

/* "rank 3" / "ranks 0-2,5" */
static void put_ranks(FILE *f, const uint32_t *idx, size_t n) {
  fputs(n == 1 ? "rank " : "ranks ", f);
  sp_fmt_ranges(f, idx, n);
}

static void put_comm(FILE *f, const comm_id *k) {
  if (strcmp(k->name, "world") == 0)
    fputs("world", f);
  else
    fprintf(f, "%s group %u", k->name, k->index);
}

static void put_fingerprint(FILE *f, const ctx *c, const coll_rec *r) {
  sp_flight_event e;
  char buf[400];
  rec_event(c, r, &e);
  sp_flight_collective(&e, buf, sizeof buf);
  fputs(buf, f);
}

/* The world's ranks that were in the job but sent no recorder: on a hang
 * they are the first suspects, and nothing in the dump shows where they
 * are. Their ranks into out; the lines go to f. */
static size_t put_silent(FILE *f, const ctx *c, const comm_id *k,
                         uint32_t *out) {
  size_t n = 0;
  if (strcmp(k->name, "world") != 0) return 0;
  for (size_t i = 0; i < c->n_ranks; i++) {
    const rank_in *r = &c->ranks[i];
    if (r->flight != NULL ||
        (r->status != NULL && strcmp(r->status, "NEVER_ATTACHED") == 0))
      continue;
    out[n++] = r->rank;
    fprintf(f, "\n    no record from rank %u: %s", r->rank,
            r->error && r->error[0] ? r->error : "it did not answer");
  }
  return n;
}

static bool same_fingerprint(const coll_rec *a, const coll_rec *b) {
  return strcmp(a->op, b->op) == 0 && a->unit == b->unit &&
         strcmp(a->dtype, b->dtype) == 0 && a->count == b->count;
}

/* The members of comm: every rank that answered for the world, the ranks
 * seen on it for a group (a group's size is not in the dump). */
static size_t members_of(const ctx *c, uint32_t comm, size_t lo, size_t hi,
                         uint32_t *out) {
  size_t n = 0;
  if (strcmp(c->comms[comm].name, "world") == 0) {
    for (size_t i = 0; i < c->n_ranks; i++)
      if (c->ranks[i].flight != NULL) out[n++] = c->ranks[i].rank;
  } else {
    for (size_t i = lo; i < hi; i++) {
      bool seen = false;
      for (size_t j = 0; j < n && !seen; j++) seen = out[j] == c->recs[i].rank;
      if (!seen) out[n++] = c->recs[i].rank;
    }
  }
  /* insertion sort: ranks arrive nearly sorted */
  for (size_t i = 1; i < n; i++)
    for (size_t j = i; j > 0 && out[j - 1] > out[j]; j--) {
      uint32_t t = out[j];
      out[j] = out[j - 1];
      out[j - 1] = t;
    }
  return n;
}

static int add_finding(sp_analysis *a, sp_finding_kind kind, const comm_id *k,
                       uint64_t seq, const uint32_t *culprits, size_t n,
                       char *text) {
  sp_finding *nf = realloc(a->findings, (a->n_findings + 1) * sizeof *nf);
  uint32_t *cp = malloc((n ? n : 1) * sizeof *cp);
  if (nf == NULL || cp == NULL) {
    free(cp);
    free(text);
    if (nf != NULL) a->findings = nf;
    return SP_ENOMEM;
  }
  a->findings = nf;
  memcpy(cp, culprits, n * sizeof *cp);
  sp_finding *f = &a->findings[a->n_findings++];
  *f = (sp_finding){.kind = kind,
                    .comm_index = k->index,
                    .seq = seq,
                    .culprits = cp,
                    .n_culprits = n,
                    .text = text};
  snprintf(f->comm, sizeof f->comm, "%s", k->name);
  return 0;
}

/* The first divergence on communicator `comm`, whose records are
 * [lo, hi) sorted by seq. */
static int analyze_comm(const ctx *c, uint32_t comm, size_t lo, size_t hi,
                        sp_analysis *a) {
  size_t cap = c->n_ranks + (hi - lo) + 1;
  uint32_t *members = malloc(cap * sizeof *members);
  uint32_t *bad = malloc(cap * sizeof *bad);
  uint32_t *good = malloc(cap * sizeof *good);
  uint64_t *max_seq = calloc(cap, sizeof *max_seq);
  uint64_t *min_seq = calloc(cap, sizeof *min_seq);
  const coll_rec **at = calloc(cap, sizeof *at);
  int rc = 0;
  if (!members || !bad || !good || !max_seq || !min_seq || !at) {
    rc = SP_ENOMEM;
    goto out;
  }
  size_t nm = members_of(c, comm, lo, hi, members);
  /* each member's window of seqs: a recorder keeps only its last events,
   * so a seq before a member's window says nothing about it */
  bool *has = calloc(nm + 1, sizeof *has);
  if (has == NULL) {
    rc = SP_ENOMEM;
    goto out;
  }
  for (size_t i = lo; i < hi; i++)
    for (size_t m = 0; m < nm; m++)
      if (members[m] == c->recs[i].rank) {
        if (!has[m] || c->recs[i].seq < min_seq[m]) min_seq[m] = c->recs[i].seq;
        if (!has[m] || c->recs[i].seq > max_seq[m]) max_seq[m] = c->recs[i].seq;
        has[m] = true;
        break;
      }
  uint64_t start = 0;
  for (size_t m = 0; m < nm; m++)
    if (has[m] && min_seq[m] > start) start = min_seq[m];
  const comm_id *k = &c->comms[comm];
  for (size_t i = lo; i < hi && rc == 0;) {
    uint64_t seq = c->recs[i].seq;
    size_t j = i;
    while (j < hi && c->recs[j].seq == seq) j++;
    if (seq < start) {
      i = j;
      continue;
    }
    size_t n_issued = 0, n_missing = 0, n_done = 0;
    for (size_t m = 0; m < nm; m++) {
      at[m] = NULL;
      for (size_t x = i; x < j; x++)
        if (c->recs[x].rank == members[m]) at[m] = &c->recs[x];
      if (at[m] != NULL) {
        n_issued++;
        if (at[m]->completed) n_done++;
      } else if (!has[m] || max_seq[m] < seq) {
        bad[n_missing++] = members[m];
      }
    }
    char *text = NULL;
    size_t tlen = 0;
    FILE *f = NULL;
    /* a dump of a live job catches its last collectives in flight: one
     * younger than SP_ANALYZE_SETTLE_US is the job moving, not stuck (and
     * every later seq is younger still) */
    uint64_t first_issue = UINT64_MAX;
    for (size_t m = 0; m < nm; m++)
      if (at[m] != NULL && at[m]->issued && at[m]->issue_us < first_issue)
        first_issue = at[m]->issue_us;
    bool settled = first_issue == UINT64_MAX ||
                   c->taken_us >= first_issue + SP_ANALYZE_SETTLE_US;
    if (n_missing > 0 && n_issued > 0 && settled) {
      if ((f = open_memstream(&text, &tlen)) == NULL) {
        rc = SP_ENOMEM;
        break;
      }
      size_t ng = 0;
      const coll_rec *ex = NULL;
      for (size_t m = 0; m < nm; m++)
        if (at[m] != NULL) {
          good[ng++] = members[m];
          if (ex == NULL) ex = at[m];
        }
      put_ranks(f, good, ng);
      fputs(" issued ", f);
      put_fingerprint(f, c, ex);
      fprintf(f, "; ");
      put_ranks(f, bad, n_missing);
      fprintf(f, " did not");
      for (size_t b = 0; b < n_missing; b++) {
        const coll_rec *last = NULL;
        for (size_t x = lo; x < hi; x++)
          if (c->recs[x].rank == bad[b]) last = &c->recs[x];
        fprintf(f, "\n    rank %u's last on ", bad[b]);
        put_comm(f, k);
        fputs(": ", f);
        if (last != NULL) {
          put_fingerprint(f, c, last);
          fputs(last->completed ? ", completed" : ", issued, not completed", f);
        } else {
          fputs("none recorded", f);
        }
      }
      put_silent(f, c, k, good);
      fclose(f);
      rc = add_finding(a, SP_FINDING_MISSING, k, seq, bad, n_missing, text);
      break;
    }
    if (n_issued == 0) {
      i = j;
      continue;
    }
    /* the majority's fingerprint is the reference; ties go to the lowest
     * rank's */
    const coll_rec *ref = NULL;
    size_t ref_n = 0;
    for (size_t m = 0; m < nm; m++) {
      if (at[m] == NULL) continue;
      size_t same = 0;
      for (size_t q = 0; q < nm; q++)
        if (at[q] != NULL && same_fingerprint(at[m], at[q])) same++;
      if (same > ref_n) {
        ref = at[m];
        ref_n = same;
      }
    }
    if (ref_n < n_issued) {
      if ((f = open_memstream(&text, &tlen)) == NULL) {
        rc = SP_ENOMEM;
        break;
      }
      size_t nb = 0;
      fputs("the members disagree:", f);
      bool *shown = calloc(nm + 1, sizeof *shown);
      for (size_t m = 0; m < nm; m++) {
        if (at[m] == NULL || (shown && shown[m])) continue;
        size_t ng = 0;
        for (size_t q = m; q < nm; q++)
          if (at[q] != NULL && same_fingerprint(at[m], at[q])) {
            good[ng++] = members[q];
            if (shown) shown[q] = true;
            if (!same_fingerprint(at[q], ref)) bad[nb++] = members[q];
          }
        fputs("\n    ", f);
        put_ranks(f, good, ng);
        fputs(": ", f);
        put_fingerprint(f, c, at[m]);
        if (at[m]->step) fprintf(f, " in step %" PRIu64, at[m]->step);
      }
      free(shown);
      fclose(f);
      rc = add_finding(a, SP_FINDING_DESYNC, k, seq, bad, nb, text);
      break;
    }
    if ((n_missing > 0 || n_done < n_issued) && !settled) break;
    if (n_done < n_issued) {
      if ((f = open_memstream(&text, &tlen)) == NULL) {
        rc = SP_ENOMEM;
        break;
      }
      size_t nb = 0, ng = 0;
      for (size_t m = 0; m < nm; m++) {
        if (at[m] == NULL) continue;
        if (at[m]->completed)
          good[ng++] = members[m];
        else
          bad[nb++] = members[m];
      }
      if (ng == 0) {
        fprintf(f, "all %zu member%s that answered issued ", n_issued,
                n_issued == 1 ? "" : "s");
        put_fingerprint(f, c, ref);
        fputs(", none completed", f);
      } else {
        put_ranks(f, bad, nb);
        fputs(" did not complete ", f);
        put_fingerprint(f, c, ref);
        fputs(", which ", f);
        put_ranks(f, good, ng);
        fputs(" completed", f);
      }
      if (first_issue != UINT64_MAX && c->taken_us >= first_issue)
        fprintf(f, " (issued %.1f s before the dump)",
                (double)(c->taken_us - first_issue) / 1e6);
      /* every rank that answered waits: the culprit is among the silent */
      size_t ns = put_silent(f, c, k, good);
      fclose(f);
      if (ns > 0 && ng == 0)
        rc = add_finding(a, SP_FINDING_STUCK, k, seq, good, ns, text);
      else
        rc = add_finding(a, SP_FINDING_STUCK, k, seq, bad, nb, text);
      break;
    }
    i = j;
  }
  free(has);
out:
  free(members);
  free(bad);
  free(good);
  free(max_seq);
  free(min_seq);
  free(at);
  return rc;
}

static int read_alerts(ctx *c, json_t *root, sp_analysis *a) {
  json_t *arr;
  int rc = sp_json_array(&c->jr, root, "alerts", "", false, SP_DUMP_MAX_ALERTS,
                         &arr);
  if (rc != 0) return rc;
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == NULL) return SP_ENOMEM;
  for (size_t i = 0; arr != NULL && i < json_array_size(arr); i++) {
    json_t *o = json_array_get(arr, i);
    char path[48];
    snprintf(path, sizeof path, "alerts[%zu]", i);
    const char *kind = NULL, *msg = NULL;
    if (!json_is_object(o)) {
      rc = sp_json_fail(&c->jr, SP_EFORMAT, "%s: expected an object", path);
      break;
    }
    if ((rc = sp_json_string(&c->jr, o, "kind", path, false, &kind)) ||
        (rc = sp_json_string(&c->jr, o, "message", path, true, &msg)))
      break;
    fprintf(f, "  %s: %s\n", kind ? kind : "ALERT", msg);
  }
  fclose(f);
  a->alerts = text;
  return rc;
}

static int read_header(ctx *c, json_t *root, sp_analysis *a) {
  const char *format, *reason = NULL;
  long long taken;
  int rc = sp_json_string(&c->jr, root, "format", "", true, &format);
  if (rc != 0) return rc;
  if (strcmp(format, "shardplane.dump/v1") != 0)
    return sp_json_fail(&c->jr, SP_EFORMAT,
                        "format: \"%s\", expected \"shardplane.dump/v1\"",
                        format);
  if ((rc = sp_json_int(&c->jr, root, "taken_unix_ms", "", true, 0,
                        LLONG_MAX / 1000, &taken)) ||
      (rc = sp_json_string(&c->jr, root, "reason", "", false, &reason)))
    return rc;
  c->taken_us = (uint64_t)taken * 1000;
  json_t *job = json_object_get(root, "job");
  const char *model = NULL, *plan = NULL, *strategy = NULL, *state = NULL,
             *verdict = NULL;
  long long world = -1;
  if (job != NULL) {
    if (!json_is_object(job))
      return sp_json_fail(&c->jr, SP_EFORMAT, "job: expected an object");
    if ((rc = sp_json_string(&c->jr, job, "model", "job", false, &model)) ||
        (rc = sp_json_string(&c->jr, job, "plan_version", "job", false,
                             &plan)) ||
        (rc = sp_json_int(&c->jr, job, "world_size", "job", false, 0,
                          UINT32_MAX, &world)) ||
        (rc = sp_json_string(&c->jr, job, "strategy", "job", false,
                             &strategy)) ||
        (rc = sp_json_string(&c->jr, job, "state", "job", false, &state)) ||
        (rc = sp_json_string(&c->jr, job, "verdict", "job", false, &verdict)))
      return rc;
  }
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == NULL) return SP_ENOMEM;
  time_t s = (time_t)(taken / 1000);
  struct tm tm;
  char when[64] = "?";
  if (gmtime_r(&s, &tm) != NULL)
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  fprintf(f, "dump taken %s", when);
  if (reason != NULL && reason[0] != '\0') fprintf(f, " (%s)", reason);
  if (model != NULL) fprintf(f, ", model %s", model);
  if (plan != NULL) fprintf(f, ", plan %s", plan);
  if (world >= 0) fprintf(f, ", world %lld", world);
  if (strategy != NULL) fprintf(f, ", %s", strategy);
  if (state != NULL) fprintf(f, ", job %s", state);
  if (verdict != NULL && verdict[0] != '\0')
    fprintf(f, "\nverdict: %s", verdict);
  fclose(f);
  a->header = text;
  return 0;
}

static int rank_last_text(const ctx *c, const rank_in *k, char **out) {
  char buf[600];
  if (k->flight == NULL) {
    snprintf(buf, sizeof buf, "no flight record: %s",
             k->error && k->error[0] ? k->error : "the rank did not answer");
  } else if (k->last == NULL) {
    snprintf(buf, sizeof buf, "no events recorded");
  } else {
    sp_flight_event e;
    sp_json_reader quiet = {c->jr.origin, NULL};
    ctx tmp = *c;
    tmp.jr = quiet;
    read_event(&tmp, k->last, "", &e); /* checked when read */
    if (e.collective) {
      /* its completion time needs the issue: from the merged record */
      for (size_t i = 0; i < c->n_comms; i++)
        if (c->comms[i].index == e.comm_index &&
            strcmp(c->comms[i].name, e.comm) == 0) {
          const coll_rec *r = find_rec(c, (uint32_t)i, e.seq, k->rank);
          if (r != NULL && e.completed && r->issued &&
              r->done_us >= r->issue_us)
            e.after_us = (int64_t)(r->done_us - r->issue_us);
        }
    }
    sp_flight_line(&e, buf, sizeof buf);
  }
  *out = strdup(buf);
  return *out ? 0 : SP_ENOMEM;
}

static int rank_cmp(const void *pa, const void *pb) {
  const rank_in *a = pa, *b = pb;
  return a->rank < b->rank ? -1 : a->rank > b->rank;
}

int sp_analyze(const char *buf, size_t len, const char *origin,
               const char *const *unit_fqns, size_t n_units, sp_analysis *out,
               sp_diag *d) {
  memset(out, 0, sizeof *out);
  ctx c = {.jr = {origin, d}, .unit_fqns = unit_fqns, .n_units = n_units};
  json_t *root = NULL;
  int rc = sp_json_parse(&c.jr, buf, len, SP_DUMP_MAX_BYTES, &root);
  if (rc != 0) return rc;
  json_t *ranks = NULL;
  if (!json_is_object(root)) {
    rc = sp_json_fail(&c.jr, SP_EFORMAT, "expected a JSON object");
    goto out;
  }
  if ((rc = read_header(&c, root, out)) || (rc = read_alerts(&c, root, out)) ||
      (rc = sp_json_array(&c.jr, root, "ranks", "", true, SP_DUMP_MAX_RANKS,
                          &ranks)))
    goto out;
  c.n_ranks = json_array_size(ranks);
  c.ranks = calloc(c.n_ranks + 1, sizeof *c.ranks);
  if (c.ranks == NULL) {
    rc = SP_ENOMEM;
    goto out;
  }
  for (size_t i = 0; i < c.n_ranks && rc == 0; i++)
    rc = read_rank(&c, json_array_get(ranks, i), i, &c.ranks[i]);
  if (rc != 0) goto out;
  qsort(c.ranks, c.n_ranks, sizeof *c.ranks, rank_cmp);
  for (size_t i = 1; i < c.n_ranks; i++)
    if (c.ranks[i].rank == c.ranks[i - 1].rank) {
      rc = sp_json_fail(&c.jr, SP_EFORMAT, "ranks: rank %u appears twice",
                        c.ranks[i].rank);
      goto out;
    }
  out->n_collectives = c.n_recs;
  merge_recs(&c);
  out->n_comms = c.n_comms;
  for (uint32_t comm = 0; comm < c.n_comms && rc == 0; comm++) {
    size_t lo = 0;
    while (lo < c.n_recs && c.recs[lo].comm != comm) lo++;
    size_t hi = lo;
    while (hi < c.n_recs && c.recs[hi].comm == comm) hi++;
    rc = analyze_comm(&c, comm, lo, hi, out);
  }
  if (rc != 0) goto out;
  out->ranks = calloc(c.n_ranks + 1, sizeof *out->ranks);
  if (out->ranks == NULL) {
    rc = SP_ENOMEM;
    goto out;
  }
  for (size_t i = 0; i < c.n_ranks && rc == 0; i++) {
    out->ranks[i].rank = c.ranks[i].rank;
    out->ranks[i].answered = c.ranks[i].flight != NULL;
    rc = rank_last_text(&c, &c.ranks[i], &out->ranks[i].text);
    out->n_ranks = i + 1;
  }
out:
  if (rc == SP_ENOMEM) sp_diag_set(d, rc, "%s: out of memory", origin);
  free(c.comms);
  free(c.recs);
  free(c.ranks);
  json_decref(root);
  if (rc != 0) sp_analysis_free(out);
  return rc;
}

void sp_analysis_free(sp_analysis *a) {
  for (size_t i = 0; i < a->n_findings; i++) {
    free(a->findings[i].culprits);
    free(a->findings[i].text);
  }
  for (size_t i = 0; i < a->n_ranks; i++) free(a->ranks[i].text);
  free(a->findings);
  free(a->ranks);
  free(a->header);
  free(a->alerts);
  memset(a, 0, sizeof *a);
}

static const char *kind_name(sp_finding_kind k) {
  switch (k) {
    case SP_FINDING_DESYNC: return "DESYNC";
    case SP_FINDING_MISSING: return "MISSING";
    default: return "STUCK";
  }
}

static void put_finding_comm(FILE *f, const sp_finding *x) {
  comm_id k;
  snprintf(k.name, sizeof k.name, "%s", x->comm);
  k.index = x->comm_index;
  put_comm(f, &k);
}

/* The ranks whose flight record is not in the dump. */
static size_t silent_ranks(const sp_analysis *a) {
  size_t n = 0;
  for (size_t i = 0; i < a->n_ranks; i++) n += !a->ranks[i].answered;
  return n;
}

void sp_analysis_print(const sp_analysis *a, FILE *f) {
  fprintf(f, "%s\n", a->header ? a->header : "");
  if (a->alerts != NULL && a->alerts[0] != '\0')
    fprintf(f, "alerts:\n%s", a->alerts);
  size_t silent = silent_ranks(a);
  if (a->n_findings == 0 && silent > 0) {
    /* "none is stuck" would be a guess: the ranks without a record may
     * be the ones that parted (an aborted job's often are) */
    fprintf(f,
            "no divergence in the records that came, but %zu of %zu "
            "rank%s sent none (below): what %s issued is not in the dump "
            "(%" PRIu64 " collective events on %zu communicator%s)\n",
            silent, a->n_ranks, a->n_ranks == 1 ? "" : "s",
            silent == 1 ? "that rank" : "they", a->n_collectives, a->n_comms,
            a->n_comms == 1 ? "" : "s");
  } else if (a->n_findings == 0) {
    fprintf(f,
            "no divergence: on %zu communicator%s, every member issued the "
            "same collectives, and none is stuck (%" PRIu64
            " collective events)\n",
            a->n_comms, a->n_comms == 1 ? "" : "s", a->n_collectives);
  } else {
    fprintf(f, "first divergence:\n");
    for (size_t i = 0; i < a->n_findings; i++) {
      const sp_finding *x = &a->findings[i];
      fputs("  ", f);
      put_finding_comm(f, x);
      fprintf(f, " #%" PRIu64 " (%s): %s\n", x->seq, kind_name(x->kind),
              x->text);
    }
  }
  fprintf(f, "last event of each rank:\n");
  for (size_t i = 0; i < a->n_ranks; i++)
    fprintf(f, "  rank %-5u %s\n", a->ranks[i].rank, a->ranks[i].text);
}

json_t *sp_analysis_json(const sp_analysis *a) {
  json_t *findings = json_array(), *ranks = json_array();
  for (size_t i = 0; i < a->n_findings; i++) {
    const sp_finding *x = &a->findings[i];
    json_t *cul = json_array();
    for (size_t j = 0; j < x->n_culprits; j++)
      json_array_append_new(cul, json_integer(x->culprits[j]));
    json_array_append_new(
        findings,
        json_pack("{s:s,s:s,s:i,s:I,s:o,s:s}", "kind", kind_name(x->kind),
                  "comm", x->comm, "comm_index", (int)x->comm_index, "seq",
                  (json_int_t)x->seq, "culprits", cul, "text", x->text));
  }
  for (size_t i = 0; i < a->n_ranks; i++)
    json_array_append_new(
        ranks,
        json_pack("{s:i,s:b,s:s}", "rank", (int)a->ranks[i].rank, "answered",
                  a->ranks[i].answered, "last", a->ranks[i].text));
  return json_pack(
      "{s:s,s:s,s:b,s:I,s:I,s:o,s:o}", "header", a->header ? a->header : "",
      "alerts", a->alerts ? a->alerts : "", "diverged", a->n_findings > 0,
      "collective_events", (json_int_t)a->n_collectives, "ranks_without_record",
      (json_int_t)silent_ranks(a), "findings", findings, "ranks", ranks);
}
