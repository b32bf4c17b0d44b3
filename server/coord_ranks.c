/* Ranks: Attach, Detach, the Session stream, ReportTransition, ListRanks,
 * Abort and the heartbeat timeouts. */
#include "coord_ranks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_events.h"
#include "coord_persist.h"
#include "coord_quorum.h"

#define SESSION_ID_LEN 32

/* A host's pressure as its agent last reported it (HostPressure), kept
 * small since every rank has one: the PSI "some avg10" shares in tenths
 * of a percent, the 1-minute load average in hundredths. */
typedef struct host_pressure {
  uint16_t cpu, memory, io; /* 0-1000 */
  uint16_t ncpu;
  uint32_t load; /* x 100 */
  bool has_psi;
} host_pressure;

/* A PSI "some avg10" share (tenths of a percent) from which a host counts
 * as under pressure: 10 % of the last 10 s with some task waiting for the
 * CPU, memory or I/O. A quiet host sits near 0 (a few percent at most);
 * the load that made a healthy rank miss its heartbeats (load average 24
 * on 2 cores) reads near 100 % for the CPU. */
#define PRESSURE_PSI 100u
/* Likewise the load average per CPU (x 100): more runnable tasks than
 * CPUs (where the kernel has no PSI). */
#define PRESSURE_LOAD 100u
/* A scheduling gap the rank reported that counts (ms), and for how long
 * after it was reported: at a 1 s heartbeat, a gap of half of it is
 * already a process that did not run when it meant to. */
#define NOTABLE_GAP_MS 500u
#define GAP_WINDOW_MS 60000u
/* How recent the agent's word that a process is alive must be (at
 * least; the heartbeat timeout when longer): agents say it every second,
 * so this is three of their reports. */
#define ALIVE_FRESH_MS 3000u

/* One per rank of the world, allocated at start: the small fields share
 * the words around session_id (216 bytes a rank with them apart, 192
 * packed; the evidence of losses at the end adds 48). */
struct sp_coord_rank {
  uint8_t status; /* Shardplane__V1__RankStatus */
  char session_id[SESSION_ID_LEN + 1];
  /* durability: restored from a state dir and not reattached yet (lost
   * after reattach_by_ms) */
  bool awaiting;
  uint32_t pid;
  char *host, *device;
  uint64_t step;
  sp_state_tracker st;
  struct {
    uint64_t seq, count;
    uint32_t unit;
    uint8_t op, dtype;
    bool set;
  } last_coll;
  uint64_t last_heard_ms;
  /* what the trainer last reported of its throughput and memory
   * (SessionUp; 0: not reported) */
  uint64_t tokens_per_step, mem_bytes, mem_peak_bytes, mem_predicted_bytes;
  uint32_t alerts;
  uint32_t snap_alerts; /* what the last written snapshot held, as below */
  char *last_alert;
  uint64_t transitions;
  sp_rpc_call *session; /* the open Session stream, if any */
  uint64_t reattach_by_ms;
  /* what the last written snapshot held */
  uint64_t snap_transitions, snap_step, gap_events;
  /* The token that attached the rank (NULL without authentication): only
   * it may speak for the rank's session. */
  const sp_rpc_principal *owner;
  /* Losses that are real: when its agent last saw its process alive (0:
   * no agent said so), the host's pressure it reported then; the largest
   * scheduling gap the rank reported lately and when; since when its loss
   * verdict is withheld (0: it is not). */
  uint64_t alive_ms, gap_at_ms, withheld_ms;
  uint32_t sched_gap_ms;
  host_pressure pressure;
};

/* Per Session call: which rank it speaks for (NULL until the first
 * message names a valid session). */
typedef struct session_ctx {
  uint32_t rank;
  bool bound;
} session_ctx;

static sp_coord *coord_of(sp_rpc_call *call) {
  return sp_rpc_call_method_user(call);
}

/* Every status change goes here, so that "are all ranks attached (or
 * detached)?" is a count, not a scan: asked at every Attach and Detach, a
 * scan made 100,000 ranks' attach O(n^2) (5e9 rank reads). */
static void set_status(sp_coord *c, sp_coord_rank *k, int status) {
  c->n_by_status[k->status]--;
  c->n_by_status[status]++;
  k->status = (uint8_t)status;
}

uint32_t sp_coord_ranks_with_status(const sp_coord *c, int status) {
  return status >= SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED &&
                 status <= SHARDPLANE__V1__RANK_STATUS__DETACHED
             ? c->n_by_status[status]
             : 0;
}

/* What the trainer reported of its throughput and memory: not reported. */
static void clear_reports(sp_coord_rank *k) {
  k->tokens_per_step = k->mem_bytes = k->mem_peak_bytes = 0;
  k->mem_predicted_bytes = 0;
  k->sched_gap_ms = 0;
  k->gap_at_ms = k->withheld_ms = 0;
}

static void replace_str(char **dst, const char *src, size_t max) {
  free(*dst);
  *dst = strndup(src ? src : "", max);
}

static void new_session_id(sp_coord *c, char *out) {
  uint8_t r[SESSION_ID_LEN / 2];
  if (uv_random(NULL, NULL, r, sizeof r, 0, NULL) != 0) {
    /* no entropy source: fall back to a counter mixed with the clock */
    uint64_t x = uv_hrtime() ^ (++c->session_counter * 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < sizeof r; i++) r[i] = (uint8_t)(x >> (8 * (i % 8)));
  }
  for (size_t i = 0; i < sizeof r; i++) snprintf(out + 2 * i, 3, "%02x", r[i]);
}

void sp_coord_ranks_summary(const sp_coord *c, Shardplane__V1__RankSummary *s,
                            uint32_t *by_state, size_t n_states) {
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    const sp_coord_rank *k = &c->ranks[r];
    switch (k->status) {
      case SHARDPLANE__V1__RANK_STATUS__ATTACHED:
        s->attached++;
        if ((size_t)k->st.root < n_states) by_state[k->st.root]++;
        break;
      case SHARDPLANE__V1__RANK_STATUS__LOST: s->lost++; break;
      case SHARDPLANE__V1__RANK_STATUS__DETACHED: s->detached++; break;
      default: s->never_attached++; break;
    }
  }
  s->n_by_root_state = n_states;
  s->by_root_state = by_state;
}

static void persist_rank(sp_coord *c, uint32_t rank);

int sp_coord_ranks_alert_logged(sp_coord *c, void *user,
                                const sp_coord_event *e) {
  (void)user;
  for (size_t j = 0; j < e->n_culprits; j++) {
    uint32_t r = e->culprits[j];
    if (r >= c->plan->world_size) continue;
    sp_coord_rank *k = &c->ranks[r];
    k->alerts++;
    free(k->last_alert);
    k->last_alert = sp_strdup(e->text);
  }
  /* the counts go with the log entry, in the same transaction */
  for (size_t j = 0; j < e->n_culprits; j++)
    if (e->culprits[j] < c->plan->world_size) persist_rank(c, e->culprits[j]);
  return 0;
}

void sp_coord_ranks_get(const sp_coord *c, uint32_t rank,
                        sp_coord_rank_view *v) {
  const sp_coord_rank *k = &c->ranks[rank];
  v->status = k->status;
  v->host = k->host;
  v->pid = k->pid;
  v->step = k->step;
  v->last_heard_ms = k->last_heard_ms;
  v->root = k->st.root;
  v->session = k->session;
  v->tokens_per_step = k->tokens_per_step;
  v->mem_bytes = k->mem_bytes;
  v->mem_peak_bytes = k->mem_peak_bytes;
  v->mem_predicted_bytes = k->mem_predicted_bytes;
  v->sched_gap_ms = k->sched_gap_ms;
  v->loss_withheld = k->withheld_ms != 0;
}

int sp_coord_ranks_status(const sp_coord *c, uint32_t rank) {
  return c->ranks[rank].status;
}

bool sp_coord_ranks_attached(const sp_coord *c, uint32_t rank) {
  return c->ranks[rank].status == SHARDPLANE__V1__RANK_STATUS__ATTACHED;
}

uint64_t sp_coord_ranks_step(const sp_coord *c, uint32_t rank) {
  return c->ranks[rank].step;
}

static int send_abort(sp_coord *c, sp_rpc_call *session, const char *reason) {
  Shardplane__V1__SessionDown d = SHARDPLANE__V1__SESSION_DOWN__INIT;
  d.command = SHARDPLANE__V1__COMMAND__ABORT;
  d.reason = (char *)reason;
  d.has_culprit = c->abort_has_culprit;
  d.culprit = c->abort_culprit;
  return sp_rpc_call_send(session, &d.base);
}

/* Tells every other live session to abort its collectives, naming the
 * culprit (a victim's loss names the rank whose fault it follows). */
static void broadcast_abort(sp_coord *c, uint32_t lost, const char *reason,
                            uint32_t culprit) {
  Shardplane__V1__SessionDown d = SHARDPLANE__V1__SESSION_DOWN__INIT;
  d.command = SHARDPLANE__V1__COMMAND__ABORT;
  d.reason = (char *)reason;
  d.has_culprit = true;
  d.culprit = culprit;
  for (uint32_t r = 0; r < c->plan->world_size; r++)
    if (r != lost && c->ranks[r].session != NULL)
      sp_rpc_call_send(c->ranks[r].session, &d.base);
}

void sp_coord_ranks_send_quorum(sp_coord *c, uint64_t epoch) {
  Shardplane__V1__SessionDown d = SHARDPLANE__V1__SESSION_DOWN__INIT;
  d.command = SHARDPLANE__V1__COMMAND__QUORUM;
  d.quorum_epoch = epoch;
  for (uint32_t r = 0; r < c->plan->world_size; r++)
    if (c->ranks[r].session != NULL)
      sp_rpc_call_send(c->ranks[r].session, &d.base);
}

/* The coordinator ends a rank's Session stream itself. A finished call gets
 * no further callback (neither on_half_close nor on_cancel), so its context
 * goes here rather than in session_ended. */
static void session_finish(sp_rpc_call *s, int code, const char *msg) {
  session_ctx *ctx = sp_rpc_call_user(s);
  sp_rpc_call_set_user(s, NULL);
  free(ctx);
  sp_rpc_call_finish(s, code, msg);
}

/* Writes one rank's registration and snapshot down (a no-op without a
 * state dir); a failure is logged by the persist side. */
static void persist_rank(sp_coord *c, uint32_t rank) {
  if (!sp_coord_persist_durable(c)) return;
  sp_coord_rank *k = &c->ranks[rank];
  sp_coord_db_rank r = {.rank = rank,
                        .status = k->status,
                        .session_id = k->session_id,
                        .host = k->host,
                        .device = k->device,
                        .pid = k->pid,
                        .step = k->step,
                        .root = k->st.root,
                        .units = k->st.units,
                        .n_units = k->st.n_units,
                        .alerts = k->alerts,
                        .transitions = k->transitions};
  if (sp_coord_persist_rank(c, &r) == 0) {
    k->snap_transitions = k->transitions;
    k->snap_step = k->step;
    k->snap_alerts = k->alerts;
  }
}

void sp_coord_ranks_snapshot(sp_coord *c) {
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    sp_coord_rank *k = &c->ranks[r];
    if (k->transitions != k->snap_transitions || k->step != k->snap_step ||
        k->alerts != k->snap_alerts)
      persist_rank(c, r);
  }
}

/* A rank as a state dir had it: everything read back is checked. */
int sp_coord_ranks_restore(sp_coord *c, const sp_coord_db_rank *r) {
  /* a rank of a larger world the job ran before (elastic nodes) */
  if (r->rank >= c->plan->world_size && r->rank < c->full_world) return 0;
  if (r->rank >= c->plan->world_size || r->n_units != c->plan->n_units ||
      r->status < SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED ||
      r->status > SHARDPLANE__V1__RANK_STATUS__DETACHED ||
      strlen(r->session_id) > SESSION_ID_LEN || strlen(r->host) > 255 ||
      strlen(r->device) > 63 || !sp_state_valid(SP_MACHINE_ROOT, r->root))
    return SP_EFORMAT;
  for (size_t u = 0; u < r->n_units; u++)
    if (!sp_state_valid(SP_MACHINE_HANDLE, r->units[u])) return SP_EFORMAT;
  sp_coord_rank *k = &c->ranks[r->rank];
  set_status(c, k, r->status);
  snprintf(k->session_id, sizeof k->session_id, "%s", r->session_id);
  replace_str(&k->host, r->host, 255);
  replace_str(&k->device, r->device, 63);
  k->pid = r->pid;
  k->step = k->snap_step = r->step;
  k->st.root = r->root;
  memcpy(k->st.units, r->units, r->n_units);
  k->alerts = k->snap_alerts = r->alerts;
  k->transitions = k->snap_transitions = r->transitions;
  uint64_t now = sp_coord_base_now_ms(c);
  k->last_heard_ms = now;
  if (k->status == SHARDPLANE__V1__RANK_STATUS__ATTACHED) {
    uint32_t grace =
        c->cfg.reattach_grace_ms ? c->cfg.reattach_grace_ms : 60000;
    k->awaiting = true;
    k->reattach_by_ms = now + grace;
  }
  return 0;
}

/* A restored rank is judged by the reattach grace, not the heartbeat:
 * its worker may be backing off. Returns true when k is such a rank (it
 * may have been marked lost here). */
static bool reattach_judged(sp_coord *c, uint32_t rank, uint64_t now);

/* evidence_ms: when the evidence of the loss began (SP_COORD_EV_LOST). */
static void mark_lost(sp_coord *c, uint32_t rank, const char *why,
                      uint64_t evidence_ms) {
  sp_coord_rank *k = &c->ranks[rank];
  if (k->status != SHARDPLANE__V1__RANK_STATUS__ATTACHED) return;
  set_status(c, k, SHARDPLANE__V1__RANK_STATUS__LOST);
  k->awaiting = false;
  k->withheld_ms = 0;
  persist_rank(c, rank);
  sp_coord_base_log(c, "rank %u lost: %s", rank, why);
  sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__RANK_LOST, rank, why,
                          NULL);
  if (k->session != NULL) {
    sp_rpc_call *s = k->session;
    k->session = NULL;
    char msg[SP_RPC_STATUS_MESSAGE_MAX];
    snprintf(msg, sizeof msg, "rank %u marked lost: %s", rank, why);
    session_finish(s, SP_RPC_ABORTED, msg);
  }
  if (c->shutting_down) return;
  /* replica groups that continue: its group is dropped, the others train
   * on (no abort, no verdict on the job) */
  char lost[SP_DIAG_MAX];
  snprintf(lost, sizeof lost, "rank %u lost: %s", rank, why);
  if (sp_coord_quorum_drop(c, rank, lost, SP_COORD_CAUSE_SEEN)) return;
  char reason[SP_DIAG_MAX] = "";
  uint32_t culprit = rank;
  sp_coord_event e = {.kind = SP_COORD_EV_LOST,
                      .rank = rank,
                      .text = why,
                      .out = reason,
                      .cap = sizeof reason,
                      .culprit = &culprit,
                      .evidence_ms = evidence_ms};
  sp_coord_bus_announce(c, &e);
  broadcast_abort(c, rank, reason, culprit);
}

/* How often the heartbeat check runs. */
static uint64_t heartbeat_period_ms(const sp_coord *c) {
  uint64_t every = c->cfg.heartbeat_timeout_ms / 4;
  return every == 0 ? 1 : every;
}

/* A rank is not to blame for the coordinator's own pauses: while the loop
 * did not run (a long handler, the process stopped, a swapped-out heap),
 * the heartbeats that came wait unread in the sockets, and after the pause
 * libuv runs timers before it reads them. The check then fires late by
 * about the pause, and that much of every rank's silence is forgiven. */
static void discount_loop_pause(sp_coord *c, uint64_t now) {
  uint64_t due = c->hb_last_check_ms + heartbeat_period_ms(c);
  if (c->hb_last_check_ms != 0 && now > due) {
    uint64_t late = now - due;
    c->loop_pause_total_ms += late;
    if (late > c->loop_pause_max_ms) c->loop_pause_max_ms = late;
    for (uint32_t r = 0; r < c->plan->world_size; r++) {
      sp_coord_rank *k = &c->ranks[r];
      if (k->status != SHARDPLANE__V1__RANK_STATUS__ATTACHED) continue;
      k->last_heard_ms += late;
      if (k->last_heard_ms > now) k->last_heard_ms = now;
    }
  }
  c->hb_last_check_ms = now;
}

static uint32_t loss_grace_ms(const sp_coord *c) {
  uint32_t g = c->cfg.loss_grace_ms;
  if (g == SP_COORD_LOSS_GRACE_OFF) return 0;
  return g ? g : SP_COORD_LOSS_GRACE_DEFAULT_MS;
}

/* Whether the rank's agent saw its process alive recently enough to
 * speak for it now. */
static bool alive_now(const sp_coord *c, const sp_coord_rank *k, uint64_t now) {
  uint64_t fresh = c->cfg.heartbeat_timeout_ms > ALIVE_FRESH_MS
                       ? c->cfg.heartbeat_timeout_ms
                       : ALIVE_FRESH_MS;
  return k->alive_ms != 0 && now - k->alive_ms <= fresh;
}

/* Whether what the rank's host and the rank itself reported explains its
 * silence: the host under pressure, or the rank descheduled lately. The
 * explanation, for the log, goes to out ("CPU pressure (some avg10
 * 85.0%)"). */
static bool silence_explained(const sp_coord_rank *k, uint64_t now, char *out,
                              size_t cap) {
  const host_pressure *p = &k->pressure;
  static const char *const names[] = {"CPU", "memory", "I/O"};
  uint16_t psi[3] = {p->cpu, p->memory, p->io};
  int worst = -1;
  for (int i = 0; i < 3 && p->has_psi; i++)
    if (psi[i] >= PRESSURE_PSI && (worst < 0 || psi[i] > psi[worst])) worst = i;
  if (worst >= 0) {
    snprintf(out, cap, "%s pressure (some avg10 %.1f%%)", names[worst],
             psi[worst] / 10.0);
    return true;
  }
  if (p->ncpu > 0 && p->load >= (uint32_t)p->ncpu * PRESSURE_LOAD) {
    snprintf(out, cap, "a load average of %.2f on %u CPUs", p->load / 100.0,
             p->ncpu);
    return true;
  }
  if (k->sched_gap_ms >= NOTABLE_GAP_MS &&
      now - k->gap_at_ms <= GAP_WINDOW_MS) {
    snprintf(out, cap, "scheduling gaps of its own (up to %.1f s)",
             k->sched_gap_ms / 1000.0);
    return true;
  }
  return false;
}

/* A rank silent past the heartbeat timeout: whether its loss verdict is
 * withheld (alive on its host, the silence explained, within the loss
 * grace). The first time says so in the log. */
static bool loss_withheld(sp_coord *c, uint32_t rank, uint64_t now) {
  sp_coord_rank *k = &c->ranks[rank];
  uint64_t silent = now - k->last_heard_ms;
  uint32_t grace = loss_grace_ms(c);
  char why[96];
  if (grace == 0 || silent > (uint64_t)c->cfg.heartbeat_timeout_ms + grace ||
      !alive_now(c, k, now) || !silence_explained(k, now, why, sizeof why))
    return false;
  if (k->withheld_ms == 0) {
    k->withheld_ms = now;
    sp_coord_base_log(c,
                      "rank %u silent for %.1f s but alive on host %s under "
                      "%s; waiting up to %.1f s more (--loss-grace-ms)",
                      rank, silent / 1000.0, k->host ? k->host : "?", why,
                      grace / 1000.0);
  }
  return true;
}

static void on_heartbeat_check(uv_timer_t *t) {
  sp_coord *c = t->data;
  uint64_t now = sp_coord_base_now_ms(c);
  discount_loop_pause(c, now);

  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    sp_coord_rank *k = &c->ranks[r];
    if (reattach_judged(c, r, now)) continue;
    if (k->status == SHARDPLANE__V1__RANK_STATUS__ATTACHED &&
        now - k->last_heard_ms > c->cfg.heartbeat_timeout_ms) {
      if (loss_withheld(c, r, now)) continue;
      char why[200];
      uint64_t silent = now - k->last_heard_ms;
      if (k->withheld_ms != 0)
        snprintf(why, sizeof why,
                 "no heartbeat for %.1f s although its process was alive on "
                 "host %s: hung (waited %.0f s past the heartbeat timeout, "
                 "--loss-grace-ms)",
                 silent / 1000.0, k->host ? k->host : "?",
                 (now - k->withheld_ms) / 1000.0);
      else
        snprintf(why, sizeof why, "no heartbeat for %llu ms",
                 (unsigned long long)silent);
      mark_lost(c, r, why, k->last_heard_ms);
    }
  }
}

/* The agent's word holds only for a rank of this incarnation that is
 * attached: one that never attached has nothing to lose. */
int sp_coord_ranks_workers_alive(sp_coord *c, void *user,
                                 const sp_coord_event *e) {
  (void)user;
  const Shardplane__V1__WorkersAlive *w = e->alive;
  const Shardplane__V1__HostPressure *hp = w->pressure;
  host_pressure p = {0};
  if (hp != NULL) {
    /* read as input: out of range (or NaN) is clamped, not trusted */
#define PCT(x)                                          \
  ((x) > 0 && (x) <= 100 ? (uint16_t)((x)*10.0f + 0.5f) \
                         : ((x) > 100 ? 1000 : 0))
    p.has_psi = hp->has_psi;
    p.cpu = PCT(hp->cpu_some_avg10);
    p.memory = PCT(hp->memory_some_avg10);
    p.io = PCT(hp->io_some_avg10);
#undef PCT
    p.load = hp->loadavg_1m > 0 && hp->loadavg_1m < 1e6f
                 ? (uint32_t)(hp->loadavg_1m * 100.0f)
                 : 0;
    p.ncpu = hp->ncpu < UINT16_MAX ? (uint16_t)hp->ncpu : UINT16_MAX;
  }
  uint64_t now = sp_coord_base_now_ms(c);
  uint32_t end = e->rank + e->n_ranks;
  if (end > c->plan->world_size) end = c->plan->world_size;
  for (uint32_t r = e->rank; r < end; r++) {
    bool alive = false;
    for (size_t i = 0; i < w->n_alive_ranks && !alive; i++)
      alive = w->alive_ranks[i] == r;
    sp_coord_rank *k = &c->ranks[r];
    if (alive) {
      k->alive_ms = now;
      k->pressure = p;
    } else if (k->status == SHARDPLANE__V1__RANK_STATUS__ATTACHED &&
               !k->awaiting) {
      char why[SP_COORD_MAX_HOST + 64];
      snprintf(why, sizeof why,
               "its process is gone from host %s (its agent "
               "says)",
               e->text);
      mark_lost(c, r, why, now);
    }
  }
  return 0;
}

int sp_coord_ranks_worker_exited(sp_coord *c, void *user,
                                 const sp_coord_event *e) {
  (void)user;
  if (e->rank >= c->plan->world_size) return 0;
  sp_coord_rank *k = &c->ranks[e->rank];
  k->alive_ms = 0;
  if (k->status != SHARDPLANE__V1__RANK_STATUS__ATTACHED || k->awaiting)
    return 0;
  char why[SP_COORD_MAX_HOST + 64];
  snprintf(why, sizeof why, "its process exited on host %s (its agent says)",
           e->text);
  mark_lost(c, e->rank, why, sp_coord_base_now_ms(c));
  return 0;
}

static bool reattach_judged(sp_coord *c, uint32_t rank, uint64_t now) {
  sp_coord_rank *k = &c->ranks[rank];
  if (!k->awaiting) return false;
  if (now > k->reattach_by_ms) {
    char why[96];
    snprintf(why, sizeof why,
             "did not reattach within %u ms of the coordinator's restart",
             c->cfg.reattach_grace_ms ? c->cfg.reattach_grace_ms : 60000);
    /* heard last when the state dir was read back */
    mark_lost(c, rank, why, k->last_heard_ms);
  }
  return true;
}

/* Validates and applies one transition; on failure fills msg (the current
 * state and the legal next ones) and returns a gRPC status. */
static int apply_transition(sp_coord *c, uint32_t rank,
                            const Shardplane__V1__Transition *t, char *msg,
                            size_t cap) {
  sp_coord_rank *k = &c->ranks[rank];
  sp_machine m = t->machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE
                     ? SP_MACHINE_HANDLE
                     : SP_MACHINE_ROOT;
  if (t->machine != SHARDPLANE__V1__MACHINE__MACHINE_ROOT &&
      t->machine != SHARDPLANE__V1__MACHINE__MACHINE_HANDLE) {
    snprintf(msg, cap, "unknown machine %d", (int)t->machine);
    return SP_RPC_INVALID_ARGUMENT;
  }
  if (m == SP_MACHINE_HANDLE && t->unit >= c->plan->n_units) {
    snprintf(msg, cap, "unit %u is out of range: the plan has units 0-%zu",
             t->unit, c->plan->n_units - 1);
    return SP_RPC_INVALID_ARGUMENT;
  }
  if (!sp_state_valid(m, t->state)) {
    snprintf(msg, cap, "%d is not a %s state", t->state,
             sp_state_machine_name(m));
    return SP_RPC_INVALID_ARGUMENT;
  }
  sp_diag d;
  int rc = sp_state_tracker_apply(
      &k->st, m, m == SP_MACHINE_HANDLE ? t->unit : 0, t->state, &d);
  if (rc != 0) {
    snprintf(msg, cap, "rank %u: %s", rank, d.msg);
    sp_coord_alerts_raisef(c, rank, "%s", d.msg);
    return SP_RPC_FAILED_PRECONDITION;
  }
  k->transitions++;
  if (t->step > k->step) k->step = t->step;
  sp_coord_event e = {
      .kind = SP_COORD_EV_TRANSITION, .rank = rank, .transition = t};
  sp_coord_bus_announce(c, &e);
  if (c->watchers != NULL)
    sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__TRANSITION, rank,
                            NULL, t);
  return SP_RPC_OK;
}

/* A worker token speaks only for the ranks it attached, whatever session
 * id it shows; an admin token for any. */
static int check_owner(const sp_coord_rank *k, uint32_t rank,
                       const sp_rpc_call *call, char *msg, size_t cap) {
  const sp_rpc_principal *p = sp_rpc_call_principal(call);
  if (p == NULL || p->role == SP_ROLE_ADMIN || k->owner == NULL ||
      k->owner == p)
    return SP_RPC_OK;
  snprintf(msg, cap, "rank %u was attached with another token than \"%s\"",
           rank, p->name);
  return SP_RPC_PERMISSION_DENIED;
}

/* Common checks of requests that speak for an attached rank. */
static int check_session(sp_coord *c, const sp_rpc_call *call, uint32_t rank,
                         const char *session_id, char *msg, size_t cap) {
  if (rank >= c->plan->world_size) {
    snprintf(msg, cap, "rank %u is out of range: the world has ranks 0-%u",
             rank, c->plan->world_size - 1);
    return SP_RPC_INVALID_ARGUMENT;
  }
  size_t idlen = session_id != NULL ? strlen(session_id) : 0;
  if (idlen > SP_COORD_MAX_SESSION_ID) {
    snprintf(msg, cap, "session_id: %zu bytes, at most %u", idlen,
             SP_COORD_MAX_SESSION_ID);
    return SP_RPC_INVALID_ARGUMENT;
  }
  sp_coord_rank *k = &c->ranks[rank];
  if (k->status != SHARDPLANE__V1__RANK_STATUS__ATTACHED) {
    snprintf(msg, cap, "rank %u is not attached (attach first)", rank);
    return SP_RPC_FAILED_PRECONDITION;
  }
  if (session_id == NULL || strcmp(session_id, k->session_id) != 0) {
    snprintf(msg, cap, "wrong session id for rank %u", rank);
    return SP_RPC_PERMISSION_DENIED;
  }
  return check_owner(k, rank, call, msg, cap);
}

/* With a state dir, an Attach without a session id from the process that
 * holds the rank (same host and pid) while no Session stream is bound: the
 * retry of an Attach whose answer was lost (the coordinator died after
 * writing it down). It gets the same session. Without a state dir no
 * answer outlives the coordinator, and a second Attach is refused. */
static bool attach_retried(const sp_coord *c, const sp_coord_rank *k,
                           const Shardplane__V1__AttachRequest *q) {
  return sp_coord_persist_durable(c) &&
         (q->session_id == NULL || q->session_id[0] == '\0') &&
         k->session == NULL && k->pid == q->pid && k->host != NULL &&
         q->host != NULL && strcmp(k->host, q->host) == 0;
}

/* What a rank registers is kept and shown: sizes checked, not cut. */
static bool attach_fields_ok(sp_rpc_call *call,
                             const Shardplane__V1__AttachRequest *q) {
  return sp_coord_base_text_ok(call, "AttachRequest", "host", q->host,
                               SP_COORD_MAX_HOST) &&
         sp_coord_base_text_ok(call, "AttachRequest", "device", q->device,
                               SP_COORD_MAX_DEVICE) &&
         sp_coord_base_text_ok(call, "AttachRequest", "plan_version",
                               q->plan_version, SP_COORD_MAX_VERSION) &&
         sp_coord_base_text_ok(call, "AttachRequest", "session_id",
                               q->session_id, SP_COORD_MAX_SESSION_ID);
}

static void on_attach(sp_rpc_call *call, const ProtobufCMessage *msg,
                      const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__AttachRequest *q =
      (const Shardplane__V1__AttachRequest *)msg;
  const sp_plan *pl = c->plan;
  if (!attach_fields_ok(call, q)) return;
  if (q->rank >= pl->world_size) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "rank %u is out of range: the world has ranks 0-%u",
                        q->rank, pl->world_size - 1);
    return;
  }
  if (q->world_size != pl->world_size) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "world size %u does not match the job's %u",
                        q->world_size, pl->world_size);
    return;
  }
  if (q->plan_version == NULL || q->plan_version[0] == '\0') {
    sp_rpc_call_finish(call, SP_RPC_INVALID_ARGUMENT,
                       "plan_version is required (the plan the rank computed)");
    return;
  }
  if (strcmp(q->plan_version, pl->version_hex) != 0) {
    sp_rpc_call_finishf(call, SP_RPC_FAILED_PRECONDITION,
                        "plan version %.32s differs from the coordinator's %s: "
                        "the rank uses another model spec or job",
                        q->plan_version, pl->version_hex);
    return;
  }
  if (c->abort_reason != NULL) {
    sp_rpc_call_finishf(call, SP_RPC_FAILED_PRECONDITION, "%s",
                        c->abort_reason);
    return;
  }
  char ended[SP_DIAG_MAX];
  sp_coord_event may = {.kind = SP_COORD_EV_ATTACHING,
                        .rank = q->rank,
                        .out = ended,
                        .cap = sizeof ended};
  if (sp_coord_bus_announce(c, &may) != 0) {
    sp_rpc_call_finish(call, SP_RPC_FAILED_PRECONDITION, ended);
    return;
  }
  sp_coord_rank *k = &c->ranks[q->rank];
  bool reattach = false;
  if (k->status == SHARDPLANE__V1__RANK_STATUS__ATTACHED) {
    if (attach_retried(c, k, q)) {
      reattach = true;
    } else if (q->session_id == NULL ||
               strcmp(q->session_id, k->session_id) != 0) {
      sp_rpc_call_finishf(call, SP_RPC_ALREADY_EXISTS,
                          "rank %u is already attached (host %s, pid %u); "
                          "reattach with its session id",
                          q->rank, k->host ? k->host : "?", k->pid);
      return;
    }
    char err[256];
    if (check_owner(k, q->rank, call, err, sizeof err) != SP_RPC_OK) {
      sp_rpc_call_finish(call, SP_RPC_PERMISSION_DENIED, err);
      return;
    }
    reattach = true;
  } else {
    new_session_id(c, k->session_id);
    /* a rank that comes back starts from a clean state */
    for (size_t u = 0; u < k->st.n_units; u++) k->st.units[u] = SP_HANDLE_IDLE;
    k->st.root = SP_ROOT_IDLE;
    /* and the process it now is has reported nothing yet: a figure of
     * the last one would pass for its own */
    clear_reports(k);
  }
  set_status(c, k, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  k->awaiting = false;
  if (!reattach) k->owner = sp_rpc_call_principal(call);
  replace_str(&k->host, q->host, SP_COORD_MAX_HOST);
  replace_str(&k->device, q->device, SP_COORD_MAX_DEVICE);
  k->pid = q->pid;
  k->last_heard_ms = sp_coord_base_now_ms(c);
  /* the session id must be on disk before the worker may use it */
  persist_rank(c, q->rank);
  Shardplane__V1__AttachResponse r = SHARDPLANE__V1__ATTACH_RESPONSE__INIT;
  r.session_id = k->session_id;
  r.plan_version = (char *)pl->version_hex;
  r.heartbeat_interval_ms = c->cfg.heartbeat_interval_ms;
  r.heartbeat_timeout_ms = c->cfg.heartbeat_timeout_ms;
  r.durable = sp_coord_persist_durable(c);
  sp_coord_persist_reply(c, call, &r.base);
  char what[400];
  snprintf(what, sizeof what, "%s from %s pid %u device %s",
           reattach ? "reattached" : "attached", k->host, k->pid, k->device);
  sp_coord_base_log(c, "rank %u %s", q->rank, what);
  sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__RANK_ATTACHED, q->rank,
                          what, NULL);
  if (!reattach) {
    sp_coord_event e = {.kind = SP_COORD_EV_ATTACHED, .rank = q->rank};
    sp_coord_bus_announce(c, &e);
  }
}

static void on_detach(sp_rpc_call *call, const ProtobufCMessage *msg,
                      const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__DetachRequest *q =
      (const Shardplane__V1__DetachRequest *)msg;
  char err[256];
  /* an admin may detach any attached rank without its session id */
  const sp_rpc_principal *p = sp_rpc_call_principal(call);
  bool forced = p != NULL && p->role == SP_ROLE_ADMIN &&
                (q->session_id == NULL || q->session_id[0] == '\0') &&
                q->rank < c->plan->world_size;
  int code = check_session(
      c, call, q->rank, forced ? c->ranks[q->rank].session_id : q->session_id,
      err, sizeof err);
  if (code != SP_RPC_OK) {
    sp_rpc_call_finish(call, code, err);
    return;
  }
  sp_coord_rank *k = &c->ranks[q->rank];
  set_status(c, k, SHARDPLANE__V1__RANK_STATUS__DETACHED);
  k->awaiting = false;
  persist_rank(c, q->rank);
  if (k->session != NULL) {
    sp_rpc_call *s = k->session;
    k->session = NULL;
    session_finish(s, SP_RPC_OK, "detached");
  }
  Shardplane__V1__DetachResponse r = SHARDPLANE__V1__DETACH_RESPONSE__INIT;
  sp_coord_persist_reply(c, call, &r.base);
  if (forced)
    sp_coord_base_log(c, "rank %u detached by token \"%s\"", q->rank, p->name);
  else
    sp_coord_base_log(c, "rank %u detached", q->rank);
  sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__RANK_DETACHED, q->rank,
                          "detached", NULL);
  sp_coord_event e = {.kind = SP_COORD_EV_DETACHED, .rank = q->rank};
  sp_coord_bus_announce(c, &e);
}

static void on_report(sp_rpc_call *call, const ProtobufCMessage *msg,
                      const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__ReportTransitionRequest *q =
      (const Shardplane__V1__ReportTransitionRequest *)msg;
  char err[SP_DIAG_MAX + 64];
  int code = check_session(c, call, q->rank, q->session_id, err, sizeof err);
  if (code == SP_RPC_OK && q->transition == NULL) {
    code = SP_RPC_INVALID_ARGUMENT;
    snprintf(err, sizeof err, "transition is required");
  }
  if (code == SP_RPC_OK) {
    c->ranks[q->rank].last_heard_ms = sp_coord_base_now_ms(c);
    code = apply_transition(c, q->rank, q->transition, err, sizeof err);
  }
  if (code != SP_RPC_OK) {
    sp_rpc_call_finish(call, code, err);
    return;
  }
  Shardplane__V1__ReportTransitionResponse r =
      SHARDPLANE__V1__REPORT_TRANSITION_RESPONSE__INIT;
  sp_rpc_call_reply(call, &r.base);
}

/* ---- Session stream ---- */

/* A worker back after a coordinator outage: its states as of the events
 * that follow replace the snapshot this coordinator restored (or kept),
 * and the events lost meanwhile are counted, not judged. */
static int resync(sp_coord *c, uint32_t rank,
                  const Shardplane__V1__SessionUp *q, char *msg, size_t cap) {
  sp_coord_rank *k = &c->ranks[rank];
  if (q->n_unit_states != k->st.n_units) {
    snprintf(msg, cap, "resync with %zu unit states; the plan has %zu units",
             q->n_unit_states, k->st.n_units);
    return SP_RPC_INVALID_ARGUMENT;
  }
  if (!sp_state_valid(SP_MACHINE_ROOT, q->root_state)) {
    snprintf(msg, cap, "resync: %d is not a root state", q->root_state);
    return SP_RPC_INVALID_ARGUMENT;
  }
  for (size_t u = 0; u < q->n_unit_states; u++)
    if (!sp_state_valid(SP_MACHINE_HANDLE, q->unit_states[u])) {
      snprintf(msg, cap, "resync: unit %zu: %d is not a unit state", u,
               q->unit_states[u]);
      return SP_RPC_INVALID_ARGUMENT;
    }
  k->st.root = q->root_state;
  for (size_t u = 0; u < q->n_unit_states; u++)
    k->st.units[u] = (uint8_t)q->unit_states[u];
  k->awaiting = false;
  k->gap_events += q->gap;
  if (q->step > k->step) k->step = q->step;
  char what[160];
  snprintf(what, sizeof what,
           "reattached its session at step %llu (%llu events not delivered "
           "while away)",
           (unsigned long long)q->step, (unsigned long long)q->gap);
  sp_coord_base_log(c, "rank %u %s", rank, what);
  sp_coord_events_publish(c, SHARDPLANE__V1__EVENT_KIND__RANK_ATTACHED, rank,
                          what, NULL);
  persist_rank(c, rank);
  return SP_RPC_OK;
}

/* A message read, in the order the diagnosis reads it: its figures, each
 * collective (all read at one instant), then what comes after them (the
 * flight record it may carry, the step it may have closed). */
static void announce_up(sp_coord *c, uint32_t rank,
                        const Shardplane__V1__SessionUp *q) {
  sp_coord_event e = {.kind = SP_COORD_EV_SESSION_UP, .rank = rank, .up = q};
  sp_coord_bus_announce(c, &e);
  if (q->n_collectives > 0) {
    sp_coord_event x = {.kind = SP_COORD_EV_COLLECTIVE,
                        .rank = rank,
                        .up = q,
                        .now_ms = sp_coord_base_now_ms(c)};
    for (size_t i = 0; i < q->n_collectives; i++) {
      x.collective = q->collectives[i];
      sp_coord_bus_announce(c, &x);
    }
  }
  e.kind = SP_COORD_EV_SESSION_UP_DONE;
  sp_coord_bus_announce(c, &e);
}

static void on_session_msg(sp_rpc_call *call, const ProtobufCMessage *msg,
                           const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__SessionUp *q = (const Shardplane__V1__SessionUp *)msg;
  session_ctx *ctx = sp_rpc_call_user(call);
  if (ctx == NULL) {
    /* the first message binds the stream to its rank */
    char err[256];
    int code = check_session(c, call, q->rank, q->session_id, err, sizeof err);
    if (code != SP_RPC_OK) {
      sp_rpc_call_finish(call, code, err);
      return;
    }
    ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) {
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return;
    }
    ctx->rank = q->rank;
    ctx->bound = true;
    sp_rpc_call_set_user(call, ctx);
    sp_coord_rank *k = &c->ranks[q->rank];
    if (k->session != NULL && k->session != call) {
      /* a newer stream of the same session wins (reconnect) */
      session_finish(k->session, SP_RPC_ABORTED,
                     "superseded by a newer session stream");
    }
    k->session = call;
    if (c->abort_reason != NULL) send_abort(c, call, c->abort_reason);
    if (q->resync && resync(c, ctx->rank, q, err, sizeof err) != SP_RPC_OK) {
      k->session = NULL;
      session_finish(call, SP_RPC_INVALID_ARGUMENT, err);
      return;
    }
  }
  if (!ctx->bound) return; /* the rank was marked lost or detached */
  sp_coord_rank *k = &c->ranks[ctx->rank];
  uint64_t now = sp_coord_base_now_ms(c);
  if (k->withheld_ms != 0) {
    sp_coord_base_log(c,
                      "rank %u heard again after %.1f s of silence (its loss "
                      "was withheld: alive under pressure)",
                      ctx->rank, (now - k->last_heard_ms) / 1000.0);
    k->withheld_ms = 0;
  }
  k->last_heard_ms = now;
  if (q->sched_gap_ms > 0 && (q->sched_gap_ms >= k->sched_gap_ms ||
                              now - k->gap_at_ms > GAP_WINDOW_MS)) {
    k->sched_gap_ms =
        q->sched_gap_ms < UINT32_MAX ? (uint32_t)q->sched_gap_ms : UINT32_MAX;
    k->gap_at_ms = now;
  }
  if (q->step > k->step) k->step = q->step;
  if (q->tokens_per_step) k->tokens_per_step = q->tokens_per_step;
  if (q->mem_bytes) k->mem_bytes = q->mem_bytes;
  if (q->mem_peak_bytes) k->mem_peak_bytes = q->mem_peak_bytes;
  if (q->mem_predicted_bytes) k->mem_predicted_bytes = q->mem_predicted_bytes;
  Shardplane__V1__SessionDown d = SHARDPLANE__V1__SESSION_DOWN__INIT;
  Shardplane__V1__Rejection rej[8];
  Shardplane__V1__Rejection *rp[8];
  char reasons[8][SP_DIAG_MAX + 64];
  d.rejections = rp;
  for (size_t i = 0; i < q->n_transitions; i++) {
    char err[SP_DIAG_MAX + 64];
    int code =
        apply_transition(c, ctx->rank, q->transitions[i], err, sizeof err);
    if (code != SP_RPC_OK && d.n_rejections < 8) {
      size_t j = d.n_rejections++;
      shardplane__v1__rejection__init(&rej[j]);
      rej[j].transition = q->transitions[i];
      memcpy(reasons[j], err, sizeof reasons[j]);
      rej[j].reason = reasons[j];
      rp[j] = &rej[j];
    }
  }
  if (q->n_collectives > 0) {
    const Shardplane__V1__Collective *col =
        q->collectives[q->n_collectives - 1];
    k->last_coll.seq = col->seq;
    k->last_coll.count = col->count;
    k->last_coll.unit = col->unit;
    k->last_coll.op = (uint8_t)col->op;
    k->last_coll.dtype = (uint8_t)col->dtype;
    k->last_coll.set = true;
  }
  announce_up(c, ctx->rank, q);
  if (!ctx->bound) return; /* a verdict ended the session meanwhile */
  d.acked_seq = q->seq;
  /* acknowledge every message: the worker bounds what it has in flight */
  sp_rpc_call_send(call, &d.base);
}

static void session_ended(sp_rpc_call *call, const char *why) {
  sp_coord *c = coord_of(call);
  session_ctx *ctx = sp_rpc_call_user(call);
  sp_rpc_call_set_user(call, NULL);
  if (ctx == NULL) return;
  if (ctx->bound && c->ranks[ctx->rank].session == call) {
    c->ranks[ctx->rank].session = NULL;
    /* the stream's end is the evidence, not the silence before it */
    mark_lost(c, ctx->rank, why, sp_coord_base_now_ms(c));
  }
  free(ctx);
}

static void on_session_half_close(sp_rpc_call *call) {
  session_ended(call, "session stream closed");
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_session_cancel(sp_rpc_call *call, int code) {
  session_ended(call, code == SP_RPC_UNAVAILABLE ? "coordinator shutting down"
                                                 : "session stream broken");
}

static void on_list_ranks(sp_rpc_call *call, const ProtobufCMessage *msg,
                          const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__ListRanksRequest *q =
      (const Shardplane__V1__ListRanksRequest *)msg;
  uint32_t first =
      q->first_rank < c->plan->world_size ? q->first_rank : c->plan->world_size;
  uint32_t w = c->plan->world_size - first;
  if (q->max_ranks != 0 && q->max_ranks < w) w = q->max_ranks;
  size_t nu = c->plan->n_units;
  Shardplane__V1__ListRanksResponse r =
      SHARDPLANE__V1__LIST_RANKS_RESPONSE__INIT;
  Shardplane__V1__RankInfo *infos = calloc((size_t)w + 1, sizeof *infos);
  Shardplane__V1__RankInfo **ptrs = calloc((size_t)w + 1, sizeof *ptrs);
  Shardplane__V1__Collective *cols = calloc((size_t)w + 1, sizeof *cols);
  int32_t *states =
      q->with_unit_states ? calloc((size_t)w * nu + 1, sizeof *states) : NULL;
  if (infos == NULL || ptrs == NULL || cols == NULL ||
      (q->with_unit_states && states == NULL)) {
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    uint64_t now = sp_coord_base_now_ms(c);
    for (uint32_t i = 0; i < w; i++) {
      const sp_coord_rank *k = &c->ranks[first + i];
      Shardplane__V1__RankInfo *x = &infos[i];
      shardplane__v1__rank_info__init(x);
      x->rank = first + i;
      x->status = (Shardplane__V1__RankStatus)k->status;
      x->host = k->host ? k->host : (char *)"";
      x->device = k->device ? k->device : (char *)"";
      x->pid = k->pid;
      x->step = k->step;
      x->root_state = k->st.root;
      if (states != NULL) {
        for (size_t u = 0; u < nu; u++) states[i * nu + u] = k->st.units[u];
        x->n_unit_states = nu;
        x->unit_states = &states[i * nu];
      }
      if (k->last_coll.set) {
        shardplane__v1__collective__init(&cols[i]);
        cols[i].seq = k->last_coll.seq;
        cols[i].count = k->last_coll.count;
        cols[i].unit = k->last_coll.unit;
        cols[i].op = (Shardplane__V1__CollectiveOp)k->last_coll.op;
        cols[i].dtype = (Shardplane__V1__DType)k->last_coll.dtype;
        x->last_collective = &cols[i];
      }
      x->last_heard_ms_ago =
          k->status == SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED
              ? 0
              : now - k->last_heard_ms;
      x->alerts = k->alerts;
      x->last_alert = k->last_alert ? k->last_alert : (char *)"";
      x->transitions = k->transitions;
      x->sched_gap_ms =
          now - k->gap_at_ms <= GAP_WINDOW_MS ? k->sched_gap_ms : 0;
      x->loss_withheld = k->withheld_ms != 0;
      sp_coord_event e = {
          .kind = SP_COORD_EV_RANK_INFO, .rank = first + i, .info = x};
      sp_coord_bus_announce(c, &e);
      ptrs[i] = x;
    }
    r.n_ranks = w;
    r.ranks = ptrs;
    sp_rpc_call_reply(call, &r.base);
  }
  free(infos);
  free(ptrs);
  free(cols);
  free(states);
}

/* Ends every rank's open Session stream with code and why. */
static void end_sessions(sp_coord *c, int code, const char *why) {
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    sp_coord_rank *k = &c->ranks[r];
    if (k->session != NULL) {
      sp_rpc_call *s = k->session;
      k->session = NULL;
      session_finish(s, code, why);
    }
  }
}

int sp_coord_ranks_new_incarnation(sp_coord *c, void *user,
                                   const sp_coord_event *e) {
  (void)user;
  /* the workers of the ended incarnation */
  end_sessions(c, SP_RPC_ABORTED, e->text);
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    sp_coord_rank *k = &c->ranks[r];
    set_status(c, k, SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED);
    k->session_id[0] = '\0';
    k->step = 0;
    for (size_t u = 0; u < k->st.n_units; u++) k->st.units[u] = SP_HANDLE_IDLE;
    k->st.root = SP_ROOT_IDLE;
    k->last_coll.set = false;
    k->awaiting = false;
    k->owner = NULL;
    k->alive_ms = 0;
    clear_reports(k);
    persist_rank(c, r);
  }
  /* an abort ended the last incarnation, not this one */
  free(c->abort_reason);
  c->abort_reason = NULL;
  c->abort_has_culprit = false;
  return 0;
}

uint32_t sp_coord_ranks_abort_all(sp_coord *c, const char *reason,
                                  bool has_culprit, uint32_t culprit) {
  if (c->abort_reason == NULL) {
    c->abort_reason = sp_strdup(reason);
    c->abort_has_culprit = has_culprit;
    c->abort_culprit = culprit;
  }
  uint32_t n = 0;
  for (uint32_t i = 0; i < c->plan->world_size; i++)
    if (c->ranks[i].session != NULL &&
        send_abort(c, c->ranks[i].session, c->abort_reason) == 0)
      n++;
  return n;
}

/* ABORT down every open Session stream (the authorize hook lets only
 * admins here when tokens are on). */
static void on_abort(sp_rpc_call *call, const ProtobufCMessage *msg,
                     const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__AbortRequest *q = (const void *)msg;
  const sp_rpc_principal *p = sp_rpc_call_principal(call);
  char reason[400];
  snprintf(reason, sizeof reason, "job aborted%s%s%s%s%.200s",
           p ? " by token \"" : "", p ? p->name : "", p ? "\"" : "",
           q->reason && q->reason[0] ? ": " : "", q->reason ? q->reason : "");
  sp_coord_base_log(c, "%s", reason);
  Shardplane__V1__AbortResponse r = SHARDPLANE__V1__ABORT_RESPONSE__INIT;
  r.sessions = sp_coord_ranks_abort_all(c, reason, false, 0);
  sp_coord_alerts_raisef(c, UINT32_MAX, "%s", reason);
  sp_coord_event e = {.kind = SP_COORD_EV_ABORTED, .text = reason};
  sp_coord_bus_announce(c, &e);
  sp_rpc_call_reply(call, &r.base);
}

#define M(name, kind, req, fn, half, cancel)                                   \
  {                                                                            \
    SP_COORD_PATH(name), kind, &shardplane__v1__##req##__descriptor, fn, half, \
        cancel, NULL                                                           \
  }

static const sp_rpc_method k_methods[] = {
    M("Attach", SP_RPC_UNARY, attach_request, on_attach, NULL, NULL),
    M("Detach", SP_RPC_UNARY, detach_request, on_detach, NULL, NULL),
    M("Session", SP_RPC_BIDI_STREAMING, session_up, on_session_msg,
      on_session_half_close, on_session_cancel),
    M("ReportTransition", SP_RPC_UNARY, report_transition_request, on_report,
      NULL, NULL),
    M("ListRanks", SP_RPC_UNARY, list_ranks_request, on_list_ranks, NULL, NULL),
    M("Abort", SP_RPC_UNARY, abort_request, on_abort, NULL, NULL),
};

int sp_coord_ranks_register(sp_coord *c) {
  return sp_coord_base_add_methods(c, k_methods,
                                   sizeof k_methods / sizeof k_methods[0]);
}

int sp_coord_ranks_init(sp_coord *c) {
  uint32_t w = c->plan->world_size;
  c->ranks = calloc(w, sizeof *c->ranks);
  if (c->ranks == NULL) return SP_ENOMEM;
  c->n_by_status[SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED] = w;
  for (uint32_t r = 0; r < w; r++) {
    int rc = sp_state_tracker_init(&c->ranks[r].st, c->plan->n_units, NULL);
    if (rc != 0) return rc;
  }
  return 0;
}

int sp_coord_ranks_resize(sp_coord *c, const sp_plan *pl) {
  sp_coord_rank *t = calloc(pl->world_size, sizeof *t);
  if (t == NULL) return SP_ENOMEM;
  for (uint32_t r = 0; r < pl->world_size; r++)
    if (sp_state_tracker_init(&t[r].st, pl->n_units, NULL) != 0) {
      for (uint32_t i = 0; i <= r; i++) sp_state_tracker_free(&t[i].st);
      free(t);
      return SP_ENOMEM;
    }
  end_sessions(c, SP_RPC_ABORTED, "the job's world changes");
  sp_coord_ranks_free(c);
  c->ranks = t;
  memset(c->n_by_status, 0, sizeof c->n_by_status);
  c->n_by_status[SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED] = pl->world_size;
  return 0;
}

void sp_coord_ranks_start(sp_coord *c) {
  uv_timer_init(c->loop, &c->heartbeat_timer);
  c->heartbeat_timer.data = c;
  c->heartbeat_started = true;
  uint64_t every = heartbeat_period_ms(c);
  uv_update_time(c->loop); /* listen may come long after the loop ran */
  c->hb_last_check_ms = sp_coord_base_now_ms(c);
  uv_timer_start(&c->heartbeat_timer, on_heartbeat_check, every, every);
}

void sp_coord_ranks_shutdown(sp_coord *c, uv_close_cb closed) {
  end_sessions(c, SP_RPC_UNAVAILABLE, "coordinator shutting down");
  if (c->heartbeat_started) {
    uv_timer_stop(&c->heartbeat_timer);
    uv_close((uv_handle_t *)&c->heartbeat_timer, closed);
  } else {
    closed((uv_handle_t *)&c->heartbeat_timer);
  }
}

void sp_coord_ranks_free(sp_coord *c) {
  if (c->ranks == NULL) return;
  for (uint32_t r = 0; r < c->plan->world_size; r++) {
    sp_coord_rank *k = &c->ranks[r];
    sp_state_tracker_free(&k->st);
    free(k->host);
    free(k->device);
    free(k->last_alert);
  }
  free(c->ranks);
  c->ranks = NULL;
}
