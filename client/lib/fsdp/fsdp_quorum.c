/* Replica groups that continue (shardplane.h, "replica groups that
 * continue"): the runtime's side of the coordinator's quorum.
 *
 * The coordinator writes the quorum into the store, under keys no worker
 * token may write: "quorum/epoch" (the newest epoch), "quorum/e/<E>" (its
 * groups, "0,2,3"), "quorum/gen/<G>" (how often group G was dropped). The
 * ranks' own keys are under "comm/quorum/". It announces a new epoch on every
 * Session stream too, but a rank only ever adopts one at a step boundary
 * and only together with its shard group: the ranks of a group must all
 * change replica groups between the same two steps, or one shard would be
 * averaged over other groups than its neighbour.
 *
 * Between groups no such agreement is needed: a group that leaves a
 * replica group frees it, so a group still in the old one fails its next
 * replica collective, discards that step and comes to the boundary too.
 * A discarded step leaves the group one step behind a group that
 * committed it; at the forming every rank writes its step count
 * ("comm/quorum/at/<E>/<shard>/<G>", steps + 1), and the groups behind receive the state
 * of the first group with the most steps. Every group at that count holds
 * the same bits (a sum over a communicator gives every member identical
 * bits), so the source is any of them.
 *
 * A rejoining process says it is ready ("comm/quorum/ready/<G>/<gen>/<rank>");
 * once its whole group is, the coordinator makes an epoch with it. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "fsdp_internal.h"

/* How often a waiting rank looks at the store again. */
#define Q_POLL_MS 50
/* A rank waits this long for a member's key before it looks for a newer
 * epoch (a member that died meanwhile never writes). */
#define Q_KEY_WAIT_MS 1000
/* A broken replica group with no newer quorum after this long asks the
 * coordinator for one with the same groups (a failure that lost nobody). */
#define Q_REFORM_MS 2000
/* A rejoining group says again that it is ready this often. */
#define Q_READY_MS 5000

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* A decimal key: *found false when absent (wait_ms 0) or not there within
 * wait_ms. */
static int get_u64(sp_session *s, const char *key, uint64_t wait_ms,
                   bool *found, uint64_t *v, sp_diag *d) {
  uint8_t *val = NULL;
  size_t len = 0;
  *found = false;
  int rc = sp_session_store_get(s, key, wait_ms, &val, &len, d);
  if (rc == SP_ENOENT || rc == SP_ETIMEDOUT) return 0;
  if (rc < 0) return rc;
  char buf[24];
  bool ok = len > 0 && len < sizeof buf;
  if (ok) {
    memcpy(buf, val, len);
    buf[len] = '\0';
    char *end;
    *v = strtoull(buf, &end, 10);
    ok = *end == '\0' && buf[0] >= '0' && buf[0] <= '9';
  }
  free(val);
  if (!ok) return sp_diag_set(d, SP_EFORMAT, "store key %s: not a count", key);
  *found = true;
  return 0;
}

static int set_str(sp_session *s, const char *key, const char *v, sp_diag *d) {
  return sp_session_store_set(s, key, v, strlen(v), d);
}

int sp_fsdp_quorum_probe(sp_session *s, uint32_t group, bool *on, uint32_t *gen,
                         sp_diag *d) {
  uint64_t v = 0;
  int rc = get_u64(s, "quorum/epoch", 0, on, &v, d);
  *gen = 0;
  if (rc < 0 || !*on) return rc;
  char key[48];
  snprintf(key, sizeof key, "quorum/gen/%u", group);
  bool found;
  rc = get_u64(s, key, 0, &found, &v, d);
  if (rc == 0 && found) *gen = (uint32_t)v;
  return rc;
}

/* The session's thread, on a newer epoch: the replica group of the old
 * one is aborted, so a collective waiting on a group that was dropped (a
 * dead peer NCCL would wait on until its timeout, a stalled one Gloo
 * would) fails now; the step is discarded and the boundary forms the new
 * group. */
static void on_quorum(void *user, uint64_t epoch) {
  sp_fsdp *f = user;
  pthread_mutex_lock(&f->q_mu);
  if (f->replica_comm != NULL && epoch > f->q_epoch)
    sp_comm_abort(f->replica_comm);
  pthread_mutex_unlock(&f->q_mu);
}

/* Replaces replica_comm (NULL: none) and the epoch it is of, together
 * under q_mu: an announcement of that very epoch must not abort it. */
static void set_replica(sp_fsdp *f, sp_comm *c, uint64_t epoch) {
  pthread_mutex_lock(&f->q_mu);
  sp_comm *old = f->replica_comm;
  f->replica_comm = c;
  f->q_epoch = epoch;
  pthread_mutex_unlock(&f->q_mu);
  sp_comm_free(old);
}

int sp_fsdp_quorum_init(sp_fsdp *f, sp_diag *d) {
  pthread_mutex_init(&f->q_mu, NULL);
  f->q_mu_init = true;
  sp_session_set_quorum_hook(f->s, on_quorum, f);
  uint32_t g = f->plan->shard_world;
  f->q_group = f->rank / g;
  f->q_shard = f->rank % g;
  f->q_groups = f->world / g;
  f->q_members = 0;
  f->q_timeout_ms = f->opts.comm_timeout_ms ? f->opts.comm_timeout_ms : 60000;
  bool on;
  int rc = sp_fsdp_quorum_probe(f->s, f->q_group, &on, &f->q_gen, d);
  /* a group started again after a drop holds no live state; the first
   * start holds the job's (initialised, or loaded) */
  f->q_joiner = f->q_gen > 0;
  f->q_in = calloc(f->q_groups, sizeof *f->q_in);
  f->q_list = calloc(f->q_groups, sizeof *f->q_list);
  if (rc == 0 && (f->q_in == NULL || f->q_list == NULL))
    rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  if (rc == 0 && !on)
    rc = sp_diag_set(d, SP_ESTATE,
                     "no replica quorum in the coordinator's store (the "
                     "runtime was given no world communicator)");
  return rc;
}

void sp_fsdp_quorum_free(sp_fsdp *f) {
  if (!f->q_on || !f->q_mu_init) return;
  sp_session_set_quorum_hook(f->s, NULL, NULL);
  set_replica(f, NULL, f->q_epoch);
  pthread_mutex_destroy(&f->q_mu);
  f->q_mu_init = false;
  free(f->q_in);
  free(f->q_list);
  f->q_in = NULL;
  f->q_list = NULL;
}

/* The first group of the quorum formed; without one formed yet, group 0. */
static uint32_t first_in(const sp_fsdp *f) {
  for (uint32_t g = 0; f->q_in && g < f->q_groups; g++)
    if (f->q_in[g]) return g;
  return 0;
}

uint32_t *sp_fsdp_ckpt_ranks(const sp_fsdp *f, size_t *n) {
  uint32_t *out = malloc((f->q_on ? f->q_groups : 1) * sizeof *out);
  *n = 0;
  if (out == NULL) return NULL;
  out[(*n)++] = f->rank;
  if (!f->q_on || !f->q_formed || f->q_group != first_in(f)) return out;
  for (uint32_t g = 0; g < f->q_groups; g++)
    if (!f->q_in[g]) out[(*n)++] = g * f->plan->shard_world + f->q_shard;
  return out;
}

uint32_t sp_fsdp_ckpt_lead(const sp_fsdp *f) {
  if (!f->q_on) return 0;
  return first_in(f) * f->plan->shard_world;
}

bool sp_fsdp_quorum_on(const sp_fsdp *f) { return f && f->q_on; }

uint32_t sp_fsdp_world_now(const sp_fsdp *f) {
  if (!f) return 0;
  if (!f->q_on) return f->world;
  return f->plan->shard_world * (f->q_members ? f->q_members : 1);
}

bool sp_fsdp_quorum_full(const sp_fsdp *f) {
  return !f || !f->q_on || f->q_members == f->q_groups;
}

void sp_fsdp_quorum_failed(sp_fsdp *f, const sp_diag *why) {
  if (!f->q_broken)
    snprintf(f->q_why, sizeof f->q_why, "%s", why ? why->msg : "");
  f->q_broken = true;
}

void sp_fsdp_quorum_finished(sp_fsdp *f, uint64_t steps) {
  if (!f || !f->q_on) return;
  char v[24];
  snprintf(v, sizeof v, "%" PRIu64, steps);
  sp_diag ignored = {{0}};
  (void)set_str(f->s, "comm/quorum/done", v, &ignored);
}

/* host[0..n) summed over the shard group, in place, on the comm lane
 * (through the runtime's storage: device memory on a GPU). */
static int shard_sum(sp_fsdp *f, double *host, size_t n, sp_diag *d) {
  void *buf = NULL;
  int rc = f->mem->alloc(f, n, sizeof(double), &buf, d);
  if (rc == 0) rc = f->mem->from_host(f, buf, host, n * sizeof(double), d);
  sp_fsdp_work w = {.kind = SP_WORK_SHARD_ALL_REDUCE,
                    .buf = buf,
                    .count = n,
                    .dt = SP_FLOAT64};
  if (rc == 0)
    sp_fsdp_fp_issue(f, &w, SP_COMM_SHARD, SP_OP_ALL_REDUCE, 0, SP_FLOAT64, n);
  int64_t t = rc == 0 ? sp_fsdp_enqueue(f, &w, d) : 0;
  if (rc == 0 && t < 0) rc = (int)t;
  if (rc == 0) rc = sp_fsdp_wait(f, t, d);
  if (rc == 0) rc = f->mem->to_host(f, host, buf, n * sizeof(double), d);
  f->mem->release(f, buf);
  return rc;
}

int sp_fsdp_quorum_commit(sp_fsdp *f, sp_diag *d) {
  if (!f->q_on) return 0;
  double broken = f->q_broken ? 1.0 : 0.0;
  int rc = shard_sum(f, &broken, 1, d);
  if (rc < 0) return sp_diag_prefix(d, rc, "agreeing on the step's commit");
  if (broken == 0.0) return 0;
  f->q_broken = true; /* a neighbour's failure: this rank re-forms too */
  rc = sp_fsdp_zero_shard_grads(f, d);
  if (rc < 0) return rc;
  return sp_diag_set(d, SP_EAGAIN,
                     "rank %u: the step is discarded: a replica collective "
                     "of group %u failed (%s)",
                     f->rank, f->q_group,
                     f->q_why[0] ? f->q_why : "on another rank of the group");
}

/* The groups of epoch e, parsed from "quorum/e/<e>" ("0,2,3"), into
 * members (f->q_groups entries at most). */
static int read_members(sp_fsdp *f, uint64_t e, uint32_t *members, uint32_t *n,
                        sp_diag *d) {
  char key[48];
  snprintf(key, sizeof key, "quorum/e/%" PRIu64, e);
  uint8_t *val = NULL;
  size_t len = 0;
  int rc = sp_session_store_get(f->s, key, Q_KEY_WAIT_MS, &val, &len, d);
  if (rc < 0) return sp_diag_prefix(d, rc, "reading the quorum %s", key);
  *n = 0;
  size_t i = 0;
  while (rc == 0 && i < len) {
    uint64_t v = 0;
    size_t start = i;
    while (i < len && val[i] >= '0' && val[i] <= '9' && v <= UINT32_MAX)
      v = v * 10 + (uint64_t)(val[i++] - '0');
    if (i == start || v >= f->q_groups || *n >= f->q_groups ||
        (i < len && val[i] != ','))
      rc =
          sp_diag_set(d, SP_EFORMAT, "store key %s: not a list of groups", key);
    else
      members[(*n)++] = (uint32_t)v;
    i++;
  }
  free(val);
  return rc;
}

/* Waits until the newest epoch is above `above`; *done when the job's steps
 * are done meanwhile. SP_ETIMEDOUT after timeout_ms. */
static int wait_newer(sp_fsdp *f, uint64_t above, uint64_t timeout_ms,
                      bool ask_reform, uint64_t *e, bool *done, sp_diag *d) {
  double start = sp_clock_s();
  bool asked = !ask_reform;
  for (;;) {
    bool found;
    uint64_t v;
    int rc = get_u64(f->s, "quorum/epoch", 0, &found, e, d);
    if (rc < 0) return rc;
    if (found && *e > above) return 0;
    rc = get_u64(f->s, "comm/quorum/done", 0, done, &v, d);
    if (rc < 0 || *done) return rc;
    double waited_ms = (sp_clock_s() - start) * 1e3;
    if (!asked && waited_ms >= Q_REFORM_MS) {
      /* the coordinator forms the same groups again */
      char key[48], who[16];
      snprintf(key, sizeof key, "comm/quorum/reform/%" PRIu64, above);
      snprintf(who, sizeof who, "%u", f->rank);
      rc = set_str(f->s, key, who, d);
      if (rc < 0) return rc;
      asked = true;
    }
    if (waited_ms >= (double)timeout_ms)
      return sp_diag_set(d, SP_ETIMEDOUT,
                         "rank %u: no replica quorum after epoch %" PRIu64
                         " within %" PRIu64 " ms",
                         f->rank, above, timeout_ms);
    sleep_ms(Q_POLL_MS);
  }
}

/* One broadcast of n elements of dt at p (runtime storage) from root. */
static int bcast(sp_fsdp *f, void *p, size_t n, sp_dtype dt, uint32_t root,
                 sp_diag *d) {
  return sp_comm_broadcast(f->replica_comm, p, n, dt, root, d);
}

/* The live state from member `root` to every member: each unit's shard,
 * each registered state, the buffers (a step counter, running
 * statistics: in their compute dtype, which the lazy init gives every
 * member first), the step count. */
static int heal(sp_fsdp *f, uint32_t root, sp_diag *d) {
  int rc = sp_fsdp_lazy_init(f, d);
  for (size_t b = 0; rc == 0 && b < f->model->n_buffers; b++)
    rc = bcast(f, f->buffers[b], (size_t)f->model->buffers[b].numel,
               f->buffer_dtype[b], root, d);
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    rc = bcast(f, fu->shard, (size_t)fu->c, fu->u->dtype, root, d);
    for (size_t i = 0; rc == 0 && i < f->n_states; i++)
      if (f->states[i].per_unit[u])
        rc = bcast(f, f->states[i].per_unit[u], (size_t)fu->c,
                   f->states[i].dtype, root, d);
  }
  double steps = (double)f->optim_steps; /* exact below 2^53 */
  void *buf = NULL;
  if (rc == 0) rc = f->mem->alloc(f, 1, sizeof steps, &buf, d);
  if (rc == 0) rc = f->mem->from_host(f, buf, &steps, sizeof steps, d);
  if (rc == 0) rc = bcast(f, buf, 1, SP_FLOAT64, root, d);
  if (rc == 0) rc = f->mem->to_host(f, &steps, buf, sizeof steps, d);
  if (buf) f->mem->release(f, buf);
  if (rc == 0) f->optim_steps = (uint64_t)steps;
  if (rc == 0) rc = sp_fsdp_shards_changed(f, d);
  return rc;
}

/* Forms the replica group of epoch e (members[0..n), this rank's group
 * among them) and brings every member to the most steps. 1: a member did
 * not come (a newer epoch is due); 0 formed; < 0 an error. */
static int form(sp_fsdp *f, uint64_t e, const uint32_t *members, uint32_t n,
                sp_diag *d) {
  set_replica(f, NULL, f->q_epoch);
  f->q_formed = false;
  char key[96], val[48];
  snprintf(key, sizeof key, "comm/quorum/at/%" PRIu64 "/%u/%u", e, f->q_shard,
           f->q_group);
  snprintf(val, sizeof val, "%" PRIu64,
           f->q_joiner ? (uint64_t)0 : f->optim_steps + 1);
  int rc = set_str(f->s, key, val, d);
  if (rc < 0) return rc;
  uint64_t best = 0;
  uint32_t me = 0, root = 0;
  bool behind = false;
  for (uint32_t i = 0; i < n; i++) {
    if (members[i] == f->q_group) me = i;
    snprintf(key, sizeof key, "comm/quorum/at/%" PRIu64 "/%u/%u", e, f->q_shard,
             members[i]);
    bool found;
    uint64_t at = 0; /* steps + 1; 0: none yet */
    rc = get_u64(f->s, key, Q_KEY_WAIT_MS, &found, &at, d);
    if (rc < 0) return rc;
    if (!found) return 1;
    if (i > 0 && at != best) behind = true;
    if (at > best) {
      best = at;
      root = i;
    }
  }
  if (best == 0)
    return sp_diag_set(
        d, SP_ESTATE,
        "epoch %" PRIu64 ": no group of the quorum holds a live state", e);
  sp_comm_opts o;
  char host[64];
  rc = sp_fsdp_comm_opts(f->s, f->q_timeout_ms, &o, host, sizeof host, d);
  if (rc < 0) return rc;
  char prefix[64];
  snprintf(prefix, sizeof prefix, "comm/replica/%u/e%" PRIu64, f->q_shard, e);
  o.prefix = prefix;
  o.rank = me;
  o.size = n;
  sp_diag cd = {{0}};
  sp_comm *made = NULL;
  if (sp_comm_new(&o, &made, &cd) < 0) {
    snprintf(f->q_why, sizeof f->q_why, "%s", cd.msg);
    return 1;
  }
  set_replica(f, made, e);
  if (behind && heal(f, root, &cd) < 0) {
    snprintf(f->q_why, sizeof f->q_why, "%s", cd.msg);
    return 1;
  }
  f->q_formed = true;
  f->q_members = n;
  memset(f->q_in, 0, f->q_groups * sizeof *f->q_in);
  for (uint32_t i = 0; i < n; i++) f->q_in[members[i]] = true;
  f->q_joiner = false;
  f->q_broken = false;
  f->q_why[0] = '\0';
  sp_fsdp_divide_factors(f->plan->shard_world * n, &f->pre_divide,
                         &f->post_divide);
  return 0;
}

int sp_fsdp_quorum_boundary(sp_fsdp *f, uint64_t *next_step, sp_diag *d) {
  if (!f || !next_step)
    return sp_diag_set(d, SP_EINVAL, "sp_fsdp_quorum_boundary: NULL");
  *next_step = f->optim_steps;
  if (!f->q_on) return 0;
  double start = sp_clock_s();
  bool said_ready = false;
  for (;;) {
    /* the group agrees whether to form, and on the epoch: every rank
     * proposes the newest it knows, and they go on once all propose the
     * same (epochs only grow: a few rounds at most) */
    uint64_t known = sp_session_quorum_epoch(f->s);
    if (known < f->q_epoch) known = f->q_epoch;
    bool need =
        f->q_broken || f->q_joiner || !f->q_formed || known != f->q_epoch;
    uint64_t e = known;
    if (need) {
      bool found;
      int rc = get_u64(f->s, "quorum/epoch", 0, &found, &e, d);
      if (rc < 0) return rc;
      if (e < known) e = known;
    }
    double v[3] = {need ? 1.0 : 0.0, (double)e, (double)e * (double)e};
    int rc = shard_sum(f, v, 3, d);
    if (rc < 0) return sp_diag_prefix(d, rc, "agreeing on the quorum");
    if (v[0] == 0.0) return 0;
    double g = f->plan->shard_world;
    /* all equal exactly when the sum of squares is g * mean^2 */
    if (v[1] != g * (double)e || v[2] != g * (double)e * (double)e) {
      sleep_ms(Q_POLL_MS);
      continue;
    }
    /* an epoch this rank tried to form already (formed and broke since,
     * or failed, here or on a neighbour): a newer one is needed */
    if (f->q_tried == e + 1) {
      bool done = false;
      uint64_t newer;
      rc = wait_newer(f, e, f->q_timeout_ms, true, &newer, &done, d);
      if (rc < 0) return rc;
      if (done) return 1;
      continue;
    }
    uint32_t *members = f->q_list, n = 0;
    rc = read_members(f, e, members, &n, d);
    if (rc < 0) return rc;
    bool in = false;
    for (uint32_t i = 0; i < n; i++) in = in || members[i] == f->q_group;
    if (!in && !f->q_joiner)
      return sp_diag_set(d, SP_ECANCELED,
                         "rank %u: replica group %u was dropped from the "
                         "quorum (epoch %" PRIu64 "); its agent restarts it",
                         f->rank, f->q_group, e);
    if (!in) {
      if (!said_ready) {
        char key[80];
        snprintf(key, sizeof key, "comm/quorum/ready/%u/%u/%u", f->q_group,
                 f->q_gen, f->rank);
        rc = set_str(f->s, key, "1", d);
        if (rc < 0) return rc;
        said_ready = true;
      }
      /* as long as the job lasts: the others may be in a long step. The
       * readiness is said again every Q_READY_MS, so a coordinator that
       * restarted meanwhile (it counts readiness in memory) hears it. */
      bool done = false;
      uint64_t newer;
      rc = wait_newer(f, e, Q_READY_MS, false, &newer, &done, d);
      if (rc == SP_ETIMEDOUT) {
        said_ready = false;
        start = sp_clock_s();
        continue;
      }
      if (rc < 0) return rc;
      if (done) return 1;
      continue;
    }
    f->q_tried = e + 1;
    rc = form(f, e, members, n, d);
    if (rc < 0) return rc;
    if (rc == 1) f->q_broken = true;
    if ((sp_clock_s() - start) * 1e3 > (double)f->q_timeout_ms * 4)
      return sp_diag_set(d, SP_ETIMEDOUT,
                         "rank %u: no replica group formed within %" PRIu64
                         " ms (%s)",
                         f->rank, f->q_timeout_ms * 4, f->q_why);
    /* formed (or not): the group agrees again, so a neighbour's failure
     * makes every rank of it form the next epoch */
    if (rc == 0) *next_step = f->optim_steps;
  }
}
