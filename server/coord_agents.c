/* The hosts' agents and the job's incarnations: AgentSession and
 * ListIncarnations.
 *
 * An incarnation is one start of the job's workers. The coordinator holds
 * its number (0 first) and a record of each: when it started, when it
 * ended and what ended it. A worker that dies is reported by its agent
 * (rank, exit code or signal). With restarts left (--max-restarts of the
 * agents) every agent is told AGENT_STOP; once each says its workers are
 * stopped, the next incarnation begins: the ranks are to attach afresh,
 * the hang detectors start over, the store is emptied (so no key of one
 * incarnation can be read by the next: none of its workers is alive by
 * then, on any host, to write one late) and every agent is told
 * AGENT_START, its workers loading the last checkpoint. Without restarts
 * left, AGENT_END names the rank and the signal.
 *
 * A coordinator with a state dir outlives its own restart: the records
 * are read back, and each agent, its stream broken, registers again
 * (rejoin) with the incarnation its workers run and whether it stopped
 * them. Until every node is back, a restart's barrier counts the missing
 * ones as still running: one that had not yet been told to stop must not
 * find the next incarnation begun while its workers of the last one live.
 * A node that is not back within the reattach grace no longer counts: it
 * may never come back, and the job must not wait on it for ever.
 *
 * Elastic nodes (agents with --nnodes MIN:MAX): an incarnation begins
 * once MIN agents are registered, after --join-wait-ms for more unless
 * MAX are there, on as many as there are (up to MAX). The coordinator
 * numbers them (the hosts of the last incarnation first, in their order)
 * and rebuilds the plan for that world (sp_coord_set_world); each agent
 * hears its node rank and the world in AGENT_START. A host that leaves
 * ends the incarnation as any lost node does (a restart, from
 * --max-restarts); one that registers while the job runs on fewer than
 * MAX ends it too, without using up a restart (the workers checkpoint on
 * the stop's SIGTERM), and the next incarnation has it. Agents beyond MAX
 * wait, unnumbered, for a later incarnation to have room.
 *
 * Everything runs on the coordinator's loop. */
#include "coord_agents.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "coord_base.h"
#include "coord_persist.h"
#include "coord_quorum.h"
#include "coord_ranks.h"
#include "coord_verdict.h"

/* Deaths reported within this long of the first one are weighed together
 * before one is named as what ended the incarnation: a victim (a rank the
 * coordinator aborted because the culprit was lost) may exit, and be
 * reported by its agent, before the culprit's agent reaps it. In
 * test_agent the victims exited 20-40 ms after the kill; their agents
 * poll every 20 ms. */
#define DECIDE_MS 300
/* Reports weighed at most (the rest of a large job's victims). */
#define MAX_CANDIDATES 64

/* Incarnations kept with their record; older ones are only counted. A
 * job restarted this often has a cause restarts will not cure. */
#define MAX_RECORDS 1024

typedef struct agent_conn {
  sp_rpc_call *call;
  uint32_t node_rank, nproc, pid;
  char host[SP_COORD_MAX_HOST + 1];
  bool registered, stopped;
  /* it has a node rank in the current world (always, for a fixed set of
   * hosts); an elastic agent waiting for room has none */
  bool placed;
  uint64_t order; /* of registration: who waited longest goes first */
  /* the incarnation + 1 in which it reported a worker's death (0: none):
   * an agent that told what happened to its workers and then left is not
   * a lost node, its report is the cause */
  uint64_t told_exit;
  struct agent_conn *prev, *next;
} agent_conn;

typedef struct inc_record {
  uint64_t number, started_ms, ended_ms;
  bool ended, has_rank;
  bool completed; /* ended by the job's completion */
  uint32_t rank;
  uint32_t world; /* elastic nodes: its world; 0: the configured one */
  int32_t exit_code, signal;
  char *reason;
} inc_record;

/* PHASE_WAITING: an elastic job's incarnation waits for its hosts. */
enum { PHASE_RUNNING, PHASE_STOPPING, PHASE_ENDED, PHASE_WAITING };

struct sp_coord_agents {
  agent_conn *list;
  uint64_t current;
  bool max_set;
  uint32_t max_restarts, restarts;
  int phase;
  char *end_reason; /* PHASE_ENDED */
  /* the deaths reported in the decision window */
  Shardplane__V1__WorkerExit cand[MAX_CANDIDATES];
  size_t n_cand;
  uv_timer_t decide;
  bool decide_init;
  uv_close_cb closed; /* the hub's, once shutdown closes decide */
  inc_record *rec;
  size_t n_rec;
  /* read back from the state dir: the agents have yet to register again,
   * and the barrier waits for every node (cleared once they cover the
   * world) */
  bool rejoining;
  /* an agent whose connection ended while its ranks trained (a node lost:
   * the host, or its Slurm step, killed): named as what ended the
   * incarnation, since no agent reports its workers' deaths */
  bool node_lost;
  uint32_t lost_node, lost_first, lost_nproc;
  char lost_host[SP_COORD_MAX_HOST + 1];
  /* when `rejoining` stops holding up a restart (sp_coord_base_now_ms) */
  uint64_t rejoin_by_ms;
  /* elastic nodes: the bounds and workers per host every agent gave
   * (min_nodes 0: a fixed set of hosts); when the wait for more hosts
   * ends (0: not waiting); the stop under way is for a host that joined
   * (no restart used up) */
  uint32_t min_nodes, max_nodes, nproc;
  uint64_t join_by_ms;
  bool bounds_set, joining;
  uint64_t registrations;
};

static sp_coord *coord_of(sp_rpc_call *call) {
  return sp_rpc_call_method_user(call);
}

static struct sp_coord_agents *agents_of(sp_coord *c) {
  if (c->agents == NULL) {
    c->agents = calloc(1, sizeof *c->agents);
    if (c->agents == NULL) return NULL;
  }
  struct sp_coord_agents *a = c->agents;
  if (a->n_rec == 0) {
    a->rec = calloc(1, sizeof *a->rec);
    if (a->rec == NULL) return NULL;
    a->rec[0] = (inc_record){.number = 0, .started_ms = sp_clock_unix_ms()};
    a->n_rec = 1;
  }
  return a;
}

static inc_record *current_rec(const struct sp_coord_agents *a) {
  return &a->rec[a->n_rec - 1];
}

/* Writes a record down (a no-op without a state dir). */
static void persist_rec(sp_coord *c, const inc_record *r) {
  sp_coord_db_incarnation x = {.number = r->number,
                               .started_ms = r->started_ms,
                               .ended_ms = r->ended_ms,
                               .ended = r->ended,
                               .has_rank = r->has_rank,
                               .rank = r->rank,
                               .max_restarts = c->agents->max_restarts,
                               .exit_code = r->exit_code,
                               .signal = r->signal,
                               .reason = r->reason,
                               .completed = r->completed,
                               .world_size = r->world};
  sp_coord_persist_incarnation(c, &x);
}

/* What AGENT_END says when the death `how` left no restart (malloc'd;
 * NULL when out of memory, which send_cmd sends as ""). */
static char *end_reason_of(const char *how, uint32_t max_restarts) {
  char end[320];
  snprintf(end, sizeof end, "%s; no restarts left (--max-restarts %u)", how,
           max_restarts);
  return strdup(end);
}

/* How long a node may take to register again after the coordinator's
 * restart: as long as its ranks may take to reattach. */
static uint64_t reattach_grace_ms(const sp_coord *c) {
  return c->cfg.reattach_grace_ms ? c->cfg.reattach_grace_ms : 60000;
}

int sp_coord_agents_restore(sp_coord *c, const sp_coord_db_incarnation *x) {
  struct sp_coord_agents *a = agents_of(c);
  if (a == NULL) return SP_ENOMEM;
  /* read back as input: in order, and within the bounds it was made in */
  bool first = x->number == 0;
  if ((first ? a->current != 0 : x->number != a->current + 1) ||
      x->max_restarts > 1000 || (x->reason && strlen(x->reason) > 512))
    return SP_EFORMAT;
  if (!first) {
    if (a->n_rec >= MAX_RECORDS) return SP_EFORMAT;
    inc_record *r = realloc(a->rec, (a->n_rec + 1) * sizeof *r);
    if (r == NULL) return SP_ENOMEM;
    a->rec = r;
    a->n_rec++;
    current_rec(a)->reason = NULL;
  }
  inc_record *r = current_rec(a);
  free(r->reason);
  *r = (inc_record){
      .number = x->number,
      .started_ms = x->started_ms,
      .ended = x->ended,
      .ended_ms = x->ended_ms,
      .has_rank = x->has_rank,
      .rank = x->rank,
      .completed = x->completed,
      .exit_code = x->exit_code,
      .signal = x->signal,
      .world = x->world_size,
      .reason = x->reason && x->reason[0] ? strdup(x->reason) : NULL};
  a->current = x->number;
  a->restarts = (uint32_t)x->number;
  a->max_restarts = x->max_restarts;
  a->max_set = true;
  a->rejoining = true;
  a->rejoin_by_ms = sp_coord_base_now_ms(c) + reattach_grace_ms(c);
  a->phase = PHASE_RUNNING;
  free(a->end_reason);
  a->end_reason = NULL;
  if (x->completed) { /* a finished job's record never changes */
    a->phase = PHASE_ENDED;
    a->end_reason = x->reason ? strdup(x->reason) : NULL;
    sp_coord_verdict_restore_completed(c);
  } else if (x->ended && a->restarts < a->max_restarts) {
    /* it stopped between a death and the next incarnation: the agents
     * stop their workers (again) and the restart goes on */
    a->phase = PHASE_STOPPING;
  } else if (x->ended) { /* it stopped after the job's end */
    a->phase = PHASE_ENDED;
    a->end_reason = end_reason_of(x->reason ? x->reason : "", a->max_restarts);
  }
  return 0;
}

static int send_cmd(const agent_conn *g, int cmd, uint64_t inc,
                    const char *reason) {
  Shardplane__V1__AgentDown d = SHARDPLANE__V1__AGENT_DOWN__INIT;
  d.command = (Shardplane__V1__AgentCommand)cmd;
  d.incarnation = inc;
  d.reason = (char *)(reason ? reason : "");
  sp_coord *c = coord_of(g->call);
  d.durable = sp_coord_persist_durable(c);
  d.completed = cmd == SHARDPLANE__V1__AGENT_COMMAND__AGENT_END &&
                current_rec(c->agents)->completed;
  d.groups_continue = sp_coord_quorum_on(c);
  if (c->agents->min_nodes > 0 && g->placed) {
    d.world_size = c->plan->world_size;
    d.node_rank = g->node_rank;
  }
  d.checkpoint =
      cmd == SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP && c->agents->joining;
  return sp_rpc_call_send(g->call, &d.base);
}

/* To every agent with a place in the world (an elastic one waiting for
 * room has no workers to start or stop). */
static void send_all(sp_coord *c, int cmd, const char *reason) {
  struct sp_coord_agents *a = c->agents;
  for (agent_conn *g = a->list; g; g = g->next)
    if (g->registered && g->placed) send_cmd(g, cmd, a->current, reason);
}

static void unlink_agent(struct sp_coord_agents *a, agent_conn *g) {
  if (g->prev)
    g->prev->next = g->next;
  else
    a->list = g->next;
  if (g->next) g->next->prev = g->prev;
}

/* Ends an agent's stream from this side and forgets it. */
static void drop_agent(struct sp_coord_agents *a, agent_conn *g, int code,
                       const char *why) {
  unlink_agent(a, g);
  sp_rpc_call_set_user(g->call, NULL);
  sp_rpc_call_finish(g->call, code, why);
  free(g);
}

/* A registration again from the agent already registered: the same
 * process on the same host, as it says (a worker token could say
 * anything, but it could as well register a node that has no agent), for
 * the same node when both have one. */
static bool same_agent(const agent_conn *o,
                       const Shardplane__V1__AgentRegister *q, bool placed) {
  return q->rejoin && q->pid == o->pid &&
         strcmp(q->host ? q->host : "", o->host) == 0 &&
         (!placed || !o->placed || o->node_rank == q->node_rank);
}

/* The store's keys, gathered as they go so that their removal is written
 * down after it. */
typedef struct key_list {
  char **k;
  size_t *len, n, cap;
} key_list;

static void note_key(void *arg, const void *key, size_t klen) {
  key_list *l = arg;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 64;
    char **k = realloc(l->k, cap * sizeof *k);
    if (k == NULL) return;
    l->k = k;
    size_t *len = realloc(l->len, cap * sizeof *len);
    if (len == NULL) return;
    l->len = len;
    l->cap = cap;
  }
  l->k[l->n] = malloc(klen + 1);
  if (l->k[l->n] == NULL) return;
  memcpy(l->k[l->n], key, klen);
  l->k[l->n][klen] = '\0';
  l->len[l->n++] = klen;
}

static void clear_store(sp_coord *c) {
  key_list l = {0};
  if (sp_kvstore_clear(c->store, note_key, &l) != 0)
    sp_coord_base_log(c,
                      "cannot empty the store for the new incarnation: out "
                      "of memory");
  for (size_t i = 0; i < l.n; i++) {
    sp_coord_persist_key(c, l.k[i], l.len[i]);
    free(l.k[i]);
  }
  free(l.k);
  free(l.len);
}

bool sp_coord_agents_restarting(const sp_coord *c) {
  return c->agents && c->agents->phase == PHASE_STOPPING;
}

void sp_coord_agents_incarnation(const sp_coord *c, uint64_t *number,
                                 uint32_t *restarts) {
  /* made with the first agent or record: none yet is incarnation 0 */
  const struct sp_coord_agents *a = c->agents;
  *number = a ? a->current : 0;
  *restarts = a ? a->restarts : 0;
}

int sp_coord_agents_alert(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  struct sp_coord_agents *a = c->agents;
  if (a == NULL) return 0;
  Shardplane__V1__AgentDown d = SHARDPLANE__V1__AGENT_DOWN__INIT;
  d.command = SHARDPLANE__V1__AGENT_COMMAND__AGENT_ALERT;
  d.incarnation = a->current;
  d.durable = sp_coord_persist_durable(c);
  d.alert = (Shardplane__V1__Alert *)e->alert;
  for (agent_conn *g = a->list; g; g = g->next)
    if (g->registered) sp_rpc_call_send(g->call, &d.base);
  return 0;
}

int sp_coord_agents_completed(sp_coord *c, void *user,
                              const sp_coord_event *e) {
  (void)user;
  uint64_t step = e->step;
  struct sp_coord_agents *a = agents_of(c);
  if (a == NULL || a->phase == PHASE_ENDED) return 0;
  inc_record *r = current_rec(a);
  char why[128];
  snprintf(why, sizeof why, "completed: all %u ranks finished at step %llu",
           c->plan->world_size, (unsigned long long)step);
  r->ended = true;
  r->completed = true;
  r->ended_ms = sp_clock_unix_ms();
  free(r->reason);
  r->reason = strdup(why);
  persist_rec(c, r);
  a->phase = PHASE_ENDED;
  free(a->end_reason);
  a->end_reason = strdup(why);
  a->n_cand = 0;
  return 0;
}

/* The current incarnation's workers start: every area starts afresh, the
 * store is emptied, every placed agent is told AGENT_START. */
static void begin(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  inc_record *r = current_rec(a);
  r->started_ms = sp_clock_unix_ms();
  if (a->min_nodes > 0) r->world = c->plan->world_size;
  a->phase = PHASE_RUNNING;
  persist_rec(c, r);
  char why[96];
  if (a->current == 0)
    snprintf(why, sizeof why, "incarnation 0 begins");
  else
    snprintf(why, sizeof why, "incarnation %llu ended; incarnation %llu begins",
             (unsigned long long)a->current - 1,
             (unsigned long long)a->current);
  sp_coord_event e = {.kind = SP_COORD_EV_INCARNATION, .text = why};
  if (sp_coord_bus_announce(c, &e) != 0)
    sp_coord_base_log(c,
                      "hang diagnosis: out of memory for the new incarnation");
  clear_store(c);
  sp_coord_quorum_reset(c);
  if (a->min_nodes > 0)
    sp_coord_base_log(c,
                      "incarnation %llu begins on %u hosts (%u ranks; "
                      "--nnodes %u:%u), restart %u of %u",
                      (unsigned long long)a->current,
                      c->plan->world_size / a->nproc, c->plan->world_size,
                      a->min_nodes, a->max_nodes, a->restarts, a->max_restarts);
  else
    sp_coord_base_log(c, "incarnation %llu begins (restart %u of %u)",
                      (unsigned long long)a->current, a->restarts,
                      a->max_restarts);
  for (agent_conn *g = a->list; g; g = g->next) g->stopped = !g->placed;
  send_all(c, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, NULL);
}

static void maybe_rendezvous(sp_coord *c);

/* Every agent stopped its workers: the next incarnation begins, at once
 * or (elastic nodes) once its hosts are there. */
static void next_incarnation(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  bool appended = false;
  if (a->n_rec < MAX_RECORDS) {
    inc_record *r = realloc(a->rec, (a->n_rec + 1) * sizeof *r);
    if (r != NULL) {
      a->rec = r;
      a->n_rec++;
      appended = true;
    }
  }
  if (!appended) { /* the last record makes way (logged) */
    sp_coord_base_log(c, "incarnation %llu replaces the record of %llu",
                      (unsigned long long)a->current + 1,
                      (unsigned long long)a->current);
    free(current_rec(a)->reason);
  }
  a->current++;
  if (!a->joining) a->restarts++; /* a host that joined used up none */
  a->joining = false;
  *current_rec(a) =
      (inc_record){.number = a->current, .started_ms = sp_clock_unix_ms()};
  if (a->min_nodes == 0) {
    begin(c);
    return;
  }
  a->phase = PHASE_WAITING;
  persist_rec(c, current_rec(a));
  maybe_rendezvous(c);
}

/* The registered agents, or those of them with a place in the world. */
static uint32_t hosts(const struct sp_coord_agents *a, bool placed) {
  uint32_t n = 0;
  for (const agent_conn *g = a->list; g; g = g->next)
    n += g->registered && (g->placed || !placed);
  return n;
}

/* Elastic nodes: the order hosts get their node ranks in. */
static int host_order(const void *x, const void *y) {
  const agent_conn *g = *(agent_conn *const *)x, *h = *(agent_conn *const *)y;
  if (g->placed != h->placed) return g->placed ? -1 : 1;
  uint64_t kg = g->placed ? g->node_rank : g->order;
  uint64_t kh = h->placed ? h->node_rank : h->order;
  return kg < kh ? -1 : kg > kh;
}

/* Elastic nodes: the current incarnation begins on the registered hosts
 * (up to MAX): the hosts of the last world keep their order, the others
 * follow as they came. The largest world the job can have among them
 * wins (a HYBRID_SHARD job needs whole shard groups). */
static void start_world(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  a->join_by_ms = 0;
  size_t n = hosts(a, false);
  agent_conn **v = calloc(n ? n : 1, sizeof *v);
  if (v == NULL) {
    sp_coord_base_log(c, "elastic nodes: out of memory; still waiting");
    return;
  }
  size_t k = 0;
  for (agent_conn *g = a->list; g; g = g->next)
    if (g->registered) v[k++] = g;
  qsort(v, n, sizeof *v, host_order);
  uint32_t take = n < a->max_nodes ? (uint32_t)n : a->max_nodes;
  sp_diag d = {{0}};
  for (; take >= a->min_nodes && take > 0; take--) {
    if (sp_coord_set_world(c, take * a->nproc, &d) == 0) break;
    sp_coord_base_log(c, "elastic nodes: no world of %u hosts: %s", take,
                      d.msg);
  }
  if (take < a->min_nodes || take == 0) {
    sp_coord_base_log(c,
                      "elastic nodes: incarnation %llu cannot begin on %zu "
                      "hosts; waiting for more",
                      (unsigned long long)a->current, n);
    free(v);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    v[i]->placed = i < take;
    v[i]->node_rank = i < take ? (uint32_t)i : 0;
  }
  free(v);
  begin(c);
}

/* Elastic nodes: whether the hosts registered let the waiting incarnation
 * begin: MAX at once, MIN after the join wait. */
static void maybe_rendezvous(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  if (a->phase != PHASE_WAITING) return;
  uint32_t n = hosts(a, false);
  if (n >= a->max_nodes) {
    start_world(c);
  } else if (n < a->min_nodes) {
    if (a->join_by_ms != 0)
      sp_coord_base_log(c, "elastic nodes: %u of at least %u hosts; waiting", n,
                        a->min_nodes);
    a->join_by_ms = 0;
  } else if (a->join_by_ms == 0) {
    uint32_t wait = c->cfg.join_wait_ms ? c->cfg.join_wait_ms
                                        : SP_COORD_JOIN_WAIT_DEFAULT_MS;
    a->join_by_ms = sp_coord_base_now_ms(c) + wait;
    sp_coord_base_log(c,
                      "elastic nodes: %u hosts (--nnodes %u:%u); incarnation "
                      "%llu begins in %u ms unless all %u come sooner",
                      n, a->min_nodes, a->max_nodes,
                      (unsigned long long)a->current, wait, a->max_nodes);
  }
}

/* After a restart of the coordinator: whether the agents registered
 * again hold every rank of the world (clears `rejoining` once they do). */
static bool every_node_back(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  if (!a->rejoining) return true;
  uint64_t ranks = 0;
  for (agent_conn *g = a->list; g; g = g->next)
    if (g->registered && g->placed) ranks += g->nproc;
  if (ranks < c->plan->world_size) return false;
  a->rejoining = false;
  return true;
}

static void maybe_all_stopped(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  if (a->phase != PHASE_STOPPING) return;
  for (agent_conn *g = a->list; g; g = g->next)
    if (g->registered && !g->stopped) return;
  if (!every_node_back(c)) return;
  next_incarnation(c);
}

/* The current incarnation ends, for a restart: every placed agent stops
 * its workers (those of an elastic job checkpoint on the SIGTERM), and
 * the next incarnation begins once all say so. */
static void stop_for_restart(sp_coord *c, const char *how) {
  struct sp_coord_agents *a = c->agents;
  a->phase = PHASE_STOPPING;
  for (agent_conn *g = a->list; g; g = g->next) g->stopped = !g->placed;
  send_all(c, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, how);
  maybe_all_stopped(c);
}

/* Elastic nodes: a host registered while the job runs on fewer than MAX;
 * the incarnation ends without using up a restart, and the next one has
 * it. */
static void host_joined(sp_coord *c, const agent_conn *g) {
  struct sp_coord_agents *a = c->agents;
  uint32_t placed = hosts(a, true);
  if (a->phase != PHASE_RUNNING || placed >= a->max_nodes ||
      current_rec(a)->completed) {
    sp_coord_base_log(c,
                      "elastic nodes: the agent from %s waits for room (the "
                      "job runs on %u of at most %u hosts)",
                      g->host, placed, a->max_nodes);
    return;
  }
  char how[SP_COORD_MAX_HOST + 128];
  snprintf(how, sizeof how,
           "a host joined (%.64s): the world grows from %u hosts at this "
           "restart",
           g->host[0] ? g->host : "an unknown host", placed);
  inc_record *r = current_rec(a);
  r->ended = true;
  r->ended_ms = sp_clock_unix_ms();
  r->has_rank = false;
  free(r->reason);
  r->reason = strdup(how);
  persist_rec(c, r);
  a->n_cand = 0;
  a->joining = true;
  sp_coord_base_log(c, "incarnation %llu ended: %s",
                    (unsigned long long)a->current, how);
  stop_for_restart(c, how);
}

int sp_coord_agents_tick(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  struct sp_coord_agents *a = c->agents;
  if (a == NULL) return 0;
  if (a->rejoining && e->now_ms >= a->rejoin_by_ms) {
    a->rejoining = false;
    sp_coord_base_log(c,
                      "not every host registered again within %llu ms of the "
                      "coordinator's restart: a restart no longer waits for "
                      "those missing",
                      (unsigned long long)reattach_grace_ms(c));
    maybe_all_stopped(c);
  }
  if (a->phase == PHASE_WAITING && a->join_by_ms != 0 &&
      e->now_ms >= a->join_by_ms)
    start_world(c);
  return 0;
}

/* The death that ended the incarnation, among those reported in the
 * window: the rank the coordinator's diagnosis names as the first fault,
 * else one killed by a signal, else the first reported. */
static const Shardplane__V1__WorkerExit *pick(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  uint32_t culprit;
  if (sp_coord_verdict_culprit(c, &culprit))
    for (size_t i = 0; i < a->n_cand; i++)
      if (a->cand[i].rank == culprit) return &a->cand[i];
  for (size_t i = 0; i < a->n_cand; i++)
    if (a->cand[i].signal > 0) return &a->cand[i];
  return &a->cand[0];
}

static void decide(uv_timer_t *t) {
  sp_coord *c = t->data;
  struct sp_coord_agents *a = c->agents;
  if (a->n_cand == 0 || a->phase != PHASE_RUNNING) return;
  const Shardplane__V1__WorkerExit *w = pick(c);
  inc_record *r = current_rec(a);
  char how[256];
  if (a->node_lost)
    snprintf(how, sizeof how,
             "node %u (ranks %u-%u on %.64s) was lost: its agent's connection "
             "ended while its workers ran",
             a->lost_node, a->lost_first, a->lost_first + a->lost_nproc - 1,
             a->lost_host[0] ? a->lost_host : "an unknown host");
  else if (w->signal > 0 && w->signal < NSIG)
    snprintf(how, sizeof how, "rank %u was killed by signal %d (%s)", w->rank,
             w->signal, strsignal(w->signal));
  else
    snprintf(how, sizeof how, "rank %u exited with status %d", w->rank,
             w->exit_code);
  r->ended = true;
  r->ended_ms = sp_clock_unix_ms();
  r->has_rank = true;
  r->rank = a->node_lost ? a->lost_first : w->rank;
  a->node_lost = false;
  r->exit_code = w->exit_code;
  r->signal = w->signal;
  free(r->reason);
  r->reason = strdup(how);
  persist_rec(c, r);
  a->n_cand = 0;
  if (a->restarts < a->max_restarts) {
    sp_coord_base_log(c,
                      "incarnation %llu ended: %s; restarting (%u of %u "
                      "restarts used)",
                      (unsigned long long)a->current, how, a->restarts,
                      a->max_restarts);
    stop_for_restart(c, how);
    return;
  }
  a->phase = PHASE_ENDED;
  free(a->end_reason);
  a->end_reason = end_reason_of(how, a->max_restarts);
  sp_coord_base_log(c, "incarnation %llu ended: %s",
                    (unsigned long long)a->current,
                    a->end_reason ? a->end_reason : how);
  send_all(c, SHARDPLANE__V1__AGENT_COMMAND__AGENT_END, a->end_reason);
}

static bool in_hosts(const agent_conn *g, uint32_t lo, uint32_t hi) {
  uint32_t first = g->node_rank * g->nproc;
  return g->registered && g->placed && first <= hi &&
         first + g->nproc - 1 >= lo;
}

void sp_coord_agents_hosts_of(const sp_coord *c, uint32_t lo, uint32_t hi,
                              uint32_t *lo_out, uint32_t *hi_out) {
  const struct sp_coord_agents *a = c->agents;
  for (const agent_conn *g = a ? a->list : NULL; g; g = g->next) {
    if (!in_hosts(g, lo, hi)) continue;
    uint32_t first = g->node_rank * g->nproc;
    if (first < *lo_out) *lo_out = first;
    if (first + g->nproc - 1 > *hi_out) *hi_out = first + g->nproc - 1;
  }
}

void sp_coord_agents_restart(sp_coord *c, uint32_t lo, uint32_t hi,
                             const char *why) {
  struct sp_coord_agents *a = c->agents;
  for (agent_conn *g = a ? a->list : NULL; g; g = g->next)
    if (in_hosts(g, lo, hi))
      send_cmd(g, SHARDPLANE__V1__AGENT_COMMAND__AGENT_RESTART, a->current,
               why);
}

/* A worker died on its own: the end of the current incarnation, decided
 * DECIDE_MS after the first report; or, with replica groups that
 * continue, the end of its group's place in the quorum. */
static void worker_died(sp_coord *c, const Shardplane__V1__WorkerExit *w) {
  struct sp_coord_agents *a = c->agents;
  if (w->incarnation != a->current || a->phase != PHASE_RUNNING) return;
  char how[160];
  if (w->signal > 0 && w->signal < NSIG)
    snprintf(how, sizeof how, "rank %u was killed by signal %d (%s)", w->rank,
             w->signal, strsignal(w->signal));
  else
    snprintf(how, sizeof how, "rank %u exited with status %d", w->rank,
             w->exit_code);
  if (sp_coord_quorum_drop(
          c, w->rank, how,
          w->signal > 0 ? SP_COORD_CAUSE_SIGNAL : SP_COORD_CAUSE_STATUS))
    return;
  if (a->n_cand < MAX_CANDIDATES) {
    Shardplane__V1__WorkerExit *x = &a->cand[a->n_cand++];
    shardplane__v1__worker_exit__init(x);
    x->incarnation = w->incarnation;
    x->rank = w->rank;
    x->exit_code = w->exit_code;
    x->signal = w->signal;
  }
  if (a->n_cand > 1) return;
  if (!a->decide_init) {
    uv_timer_init(c->loop, &a->decide);
    a->decide.data = c;
    a->decide_init = true;
  }
  uv_timer_start(&a->decide, decide, DECIDE_MS, 0);
}

/* Elastic nodes: the bounds of the first agent hold for the job (and its
 * workers per host); false when the call was ended. */
static bool same_bounds(sp_coord *c, sp_rpc_call *call,
                        const Shardplane__V1__AgentRegister *q) {
  struct sp_coord_agents *a = c->agents;
  if (q->min_nodes > 0 &&
      (q->max_nodes < q->min_nodes ||
       (uint64_t)q->max_nodes * q->nproc != c->full_world)) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "--nnodes %u:%u with --nproc-per-node %u: at most "
                        "%llu ranks, but the job's world (its largest) is %u",
                        q->min_nodes, q->max_nodes, q->nproc,
                        (unsigned long long)q->max_nodes * q->nproc,
                        c->full_world);
    return false;
  }
  if (!a->bounds_set) { /* this coordinator's first agent */
    a->bounds_set = true;
    a->min_nodes = q->min_nodes;
    a->max_nodes = q->max_nodes;
    a->nproc = q->nproc;
  }
  if (q->min_nodes != a->min_nodes || q->max_nodes != a->max_nodes ||
      (q->min_nodes > 0 && q->nproc != a->nproc)) {
    char mine[48], theirs[48];
    snprintf(mine, sizeof mine, q->min_nodes ? "--nnodes %u:%u" : "fixed hosts",
             q->min_nodes, q->max_nodes);
    snprintf(theirs, sizeof theirs,
             a->min_nodes ? "--nnodes %u:%u" : "fixed hosts", a->min_nodes,
             a->max_nodes);
    sp_rpc_call_finishf(call, SP_RPC_FAILED_PRECONDITION,
                        "%s with --nproc-per-node %u differs from the job's "
                        "first agent (%s with --nproc-per-node %u)",
                        mine, q->nproc, theirs, a->nproc);
    return false;
  }
  return true;
}

/* Whether q may keep the node rank it says it has: a fixed host always
 * (checked against the world), an elastic one only when it rejoins the
 * incarnation it was numbered in. */
static bool keeps_node(const struct sp_coord_agents *a,
                       const Shardplane__V1__AgentRegister *q) {
  return q->min_nodes == 0 ||
         (q->rejoin && q->incarnation == a->current &&
          (a->phase == PHASE_RUNNING || a->phase == PHASE_STOPPING) &&
          current_rec(a)->world != 0);
}

/* The first message: which node, how many workers, how many restarts. */
static bool register_agent(sp_coord *c, sp_rpc_call *call, agent_conn *g,
                           const Shardplane__V1__AgentRegister *q) {
  struct sp_coord_agents *a = c->agents;
  uint32_t world = c->plan->world_size;
  if (!sp_coord_base_text_ok(call, "AgentRegister", "host", q->host,
                             SP_COORD_MAX_HOST))
    return false;
  bool placed = keeps_node(a, q);
  if (q->nproc == 0 || q->nproc > c->full_world ||
      (placed && (uint64_t)q->node_rank * q->nproc + q->nproc > world)) {
    sp_rpc_call_finishf(
        call, SP_RPC_INVALID_ARGUMENT,
        "node %u with %u workers: ranks %llu-%llu are not "
        "all in the job's world of %u",
        q->node_rank, q->nproc, (unsigned long long)q->node_rank * q->nproc,
        (unsigned long long)q->node_rank * q->nproc + q->nproc - 1, world);
    return false;
  }
  if (!same_bounds(c, call, q)) return false;
  /* a late agent of a completed job is told so, whatever it asks */
  if (a->max_set && q->max_restarts != a->max_restarts &&
      !current_rec(a)->completed) {
    sp_rpc_call_finishf(call, SP_RPC_FAILED_PRECONDITION,
                        "--max-restarts %u differs from the %u the job's "
                        "first agent gave",
                        q->max_restarts, a->max_restarts);
    return false;
  }
  if (q->rejoin && q->incarnation > a->current) {
    sp_rpc_call_finishf(call, SP_RPC_FAILED_PRECONDITION,
                        "node %u's agent runs incarnation %llu; this "
                        "coordinator's job is at incarnation %llu (is its "
                        "--state-dir the job's?)",
                        q->node_rank, (unsigned long long)q->incarnation,
                        (unsigned long long)a->current);
    return false;
  }
  for (agent_conn *o = a->list; o; o = o->next) {
    if (!o->registered) continue;
    if (same_agent(o, q, placed)) {
      /* its old stream broke without the coordinator noticing yet: the
       * new one takes its place */
      drop_agent(a, o, SP_RPC_UNAVAILABLE,
                 "the agent registered again on a new stream");
      break;
    }
    if (placed && o->placed && o->node_rank == q->node_rank) {
      sp_rpc_call_finishf(call, SP_RPC_ALREADY_EXISTS,
                          "node %u already has an agent", q->node_rank);
      return false;
    }
  }
  if (!a->max_set) { /* the job's first agent: the record starts here */
    a->max_set = true;
    a->max_restarts = q->max_restarts;
    persist_rec(c, current_rec(a));
  }
  g->registered = true;
  g->placed = placed;
  g->order = ++a->registrations;
  g->node_rank = placed ? q->node_rank : 0;
  g->nproc = q->nproc;
  g->pid = q->pid;
  snprintf(g->host, sizeof g->host, "%s", q->host ? q->host : "");
  /* a stop it already made counts for the barrier; an agent without a
   * place has no workers to stop */
  g->stopped =
      !placed || (q->rejoin && q->stopped && q->incarnation == a->current);
  if (q->rejoin)
    sp_coord_base_log(c,
                      "agent of node %u (%u workers) from %s pid %u registered "
                      "again, at incarnation %llu%s",
                      q->node_rank, q->nproc, q->host ? q->host : "?", q->pid,
                      (unsigned long long)q->incarnation,
                      q->stopped ? ", its workers stopped" : "");
  else if (q->min_nodes > 0)
    sp_coord_base_log(c, "agent of an elastic host (%u workers) from %s pid %u",
                      q->nproc, q->host ? q->host : "?", q->pid);
  else
    sp_coord_base_log(c, "agent of node %u (%u workers) from %s pid %u",
                      q->node_rank, q->nproc, q->host ? q->host : "?", q->pid);
  /* an elastic job's first incarnation begins with its hosts */
  if (a->min_nodes > 0 && a->phase == PHASE_RUNNING &&
      current_rec(a)->world == 0)
    a->phase = PHASE_WAITING;
  if (a->phase == PHASE_ENDED)
    send_cmd(g, SHARDPLANE__V1__AGENT_COMMAND__AGENT_END, a->current,
             a->end_reason);
  else if (!placed)
    ; /* told when an incarnation has room for it (after_register) */
  else if (a->phase == PHASE_STOPPING)
    send_cmd(g, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, a->current,
             current_rec(a)->reason);
  else
    send_cmd(g, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, a->current, NULL);
  return true;
}

/* Once the agent is in the list: what its arrival starts. */
static void after_register(sp_coord *c, const agent_conn *g) {
  struct sp_coord_agents *a = c->agents;
  (void)every_node_back(c);
  if (a->phase == PHASE_WAITING)
    maybe_rendezvous(c);
  else if (!g->placed && a->phase == PHASE_RUNNING)
    host_joined(c, g);
  else if (g->stopped) /* back with its workers stopped: a restart may go on */
    maybe_all_stopped(c);
}

/* The agent's word on its workers (about every second): checked, then
 * announced for the ranks' heartbeat check to weigh. A rank not of the
 * node ends the stream (as for a WorkerExit); a report of another
 * incarnation than the current one (sent before the agent heard of the
 * new one) is dropped. Returns false when the stream was ended. */
static bool workers_alive(sp_coord *c, sp_rpc_call *call, agent_conn *g,
                          const Shardplane__V1__WorkersAlive *w) {
  struct sp_coord_agents *a = c->agents;
  uint32_t first = g->node_rank * g->nproc;
  for (size_t i = 0; i < w->n_alive_ranks; i++)
    if (w->alive_ranks[i] < first || w->alive_ranks[i] >= first + g->nproc) {
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                          "alive rank %u is not one of node %u's",
                          w->alive_ranks[i], g->node_rank);
      unlink_agent(a, g);
      sp_rpc_call_set_user(call, NULL);
      free(g);
      maybe_all_stopped(c);
      return false;
    }
  if (w->incarnation != a->current || a->phase != PHASE_RUNNING) return true;
  sp_coord_event e = {.kind = SP_COORD_EV_WORKERS_ALIVE,
                      .rank = first,
                      .n_ranks = g->nproc,
                      .alive = w,
                      .text = g->host};
  sp_coord_bus_announce(c, &e);
  return true;
}

static void on_agent_msg(sp_rpc_call *call, const ProtobufCMessage *msg,
                         const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__AgentUp *q = (const Shardplane__V1__AgentUp *)msg;
  struct sp_coord_agents *a = agents_of(c);
  if (a == NULL) {
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  agent_conn *g = sp_rpc_call_user(call);
  if (g == NULL) {
    if (q->register_ == NULL) {
      sp_rpc_call_finish(call, SP_RPC_INVALID_ARGUMENT,
                         "the first AgentUp must carry register");
      return;
    }
    g = calloc(1, sizeof *g);
    if (g == NULL) {
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return;
    }
    g->call = call;
    if (!register_agent(c, call, g, q->register_)) {
      free(g);
      return;
    }
    g->next = a->list;
    if (a->list) a->list->prev = g;
    a->list = g;
    sp_rpc_call_set_user(call, g);
    after_register(c, g);
    return;
  }
  if (q->register_ != NULL) {
    drop_agent(a, g, SP_RPC_INVALID_ARGUMENT,
               "register comes in the first AgentUp only");
    maybe_all_stopped(c);
    return;
  }
  if (!g->placed) return; /* no workers: nothing else to hear */
  if (q->worker_exit != NULL) {
    const Shardplane__V1__WorkerExit *w = q->worker_exit;
    if (w->rank < g->node_rank * g->nproc ||
        w->rank >= g->node_rank * g->nproc + g->nproc) {
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                          "rank %u is not one of node %u's", w->rank,
                          g->node_rank);
      unlink_agent(a, g);
      sp_rpc_call_set_user(call, NULL);
      free(g);
      maybe_all_stopped(c);
      return;
    }
    g->told_exit = a->current + 1;
    worker_died(c, w);
    if (w->incarnation == a->current) {
      sp_coord_event e = {
          .kind = SP_COORD_EV_WORKER_EXITED, .rank = w->rank, .text = g->host};
      sp_coord_bus_announce(c, &e);
    }
  }
  if (q->alive != NULL && !workers_alive(c, call, g, q->alive)) return;
  if (q->stopped && q->incarnation == a->current) {
    g->stopped = true;
    maybe_all_stopped(c);
  }
}

static void agent_gone(sp_rpc_call *call) {
  sp_coord *c = coord_of(call);
  agent_conn *g = sp_rpc_call_user(call);
  if (g == NULL || c->agents == NULL) return;
  sp_rpc_call_set_user(call, NULL);
  struct sp_coord_agents *a = c->agents;
  /* a node lost: its agent went away while its ranks trained (attached,
   * or already lost with their sessions on its connection) */
  bool training = false;
  if (g->registered && g->placed && !g->stopped &&
      g->told_exit != a->current + 1 && !c->shutting_down &&
      a->phase == PHASE_RUNNING)
    for (uint32_t i = 0; i < g->nproc; i++) {
      int st = sp_coord_ranks_status(c, g->node_rank * g->nproc + i);
      if (st == SHARDPLANE__V1__RANK_STATUS__ATTACHED ||
          st == SHARDPLANE__V1__RANK_STATUS__LOST)
        training = true;
    }
  uint32_t first = g->node_rank * g->nproc;
  char lost[SP_COORD_MAX_HOST + 96];
  snprintf(lost, sizeof lost, "node %u (%s) was lost: its agent went away",
           g->node_rank, g->host);
  if (training && sp_coord_quorum_drop(c, first, lost, SP_COORD_CAUSE_NODE))
    training = false;
  if (training) {
    sp_coord_base_log(c,
                      "node %u lost: its agent (%s pid %u, ranks %u-%u) went "
                      "away while its workers ran",
                      g->node_rank, g->host, g->pid, first,
                      first + g->nproc - 1);
    if (!a->node_lost) {
      a->node_lost = true;
      a->lost_node = g->node_rank;
      a->lost_first = first;
      a->lost_nproc = g->nproc;
      snprintf(a->lost_host, sizeof a->lost_host, "%s", g->host);
    }
  }
  unlink_agent(a, g);
  free(g);
  /* an agent that left does not hold up a restart (its host's ranks
   * then never attach, and the job waits as for any missing rank) */
  if (!c->shutting_down) maybe_all_stopped(c);
  if (!c->shutting_down) maybe_rendezvous(c);
}

static void on_agent_half_close(sp_rpc_call *call) {
  agent_gone(call);
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_agent_cancel(sp_rpc_call *call, int code) {
  (void)code;
  agent_gone(call);
}

static void on_list_incarnations(sp_rpc_call *call, const ProtobufCMessage *msg,
                                 const uint8_t *raw, size_t len) {
  (void)msg;
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  struct sp_coord_agents *a = agents_of(c);
  if (a == NULL) {
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  Shardplane__V1__ListIncarnationsResponse r =
      SHARDPLANE__V1__LIST_INCARNATIONS_RESPONSE__INIT;
  r.current = a->current;
  r.max_restarts = a->max_restarts;
  r.restarts = a->restarts;
  Shardplane__V1__Incarnation *items = calloc(a->n_rec, sizeof *items);
  Shardplane__V1__Incarnation **ptrs = calloc(a->n_rec, sizeof *ptrs);
  if (items == NULL || ptrs == NULL) {
    free(items);
    free(ptrs);
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  for (size_t i = 0; i < a->n_rec; i++) {
    const inc_record *e = &a->rec[i];
    Shardplane__V1__Incarnation *x = &items[i];
    shardplane__v1__incarnation__init(x);
    x->number = e->number;
    x->started_unix_ms = e->started_ms;
    x->ended = e->ended;
    x->ended_unix_ms = e->ended_ms;
    x->has_rank = e->has_rank;
    x->rank = e->rank;
    x->exit_code = e->exit_code;
    x->signal = e->signal;
    x->completed = e->completed;
    x->world_size = e->world;
    x->reason = e->reason ? e->reason : "";
    ptrs[i] = x;
  }
  r.n_incarnations = a->n_rec;
  r.incarnations = ptrs;
  r.quorum = sp_coord_quorum_report(c);
  sp_rpc_call_reply(call, &r.base);
  free(r.quorum);
  free(items);
  free(ptrs);
}

#define M(name, kind, req, fn, half, cancel)                                   \
  {                                                                            \
    SP_COORD_PATH(name), kind, &shardplane__v1__##req##__descriptor, fn, half, \
        cancel, NULL                                                           \
  }

static const sp_rpc_method k_methods[] = {
    M("AgentSession", SP_RPC_BIDI_STREAMING, agent_up, on_agent_msg,
      on_agent_half_close, on_agent_cancel),
    M("ListIncarnations", SP_RPC_UNARY, list_incarnations_request,
      on_list_incarnations, NULL, NULL),
};

static void decide_closed(uv_handle_t *h) {
  sp_coord *c = h->data;
  c->agents->decide_init = false;
  c->agents->closed(h);
}

int sp_coord_agents_register(sp_coord *c) {
  if (agents_of(c) == NULL) return SP_ENOMEM;
  return sp_coord_base_add_methods(c, k_methods,
                                   sizeof k_methods / sizeof k_methods[0]);
}

bool sp_coord_agents_shutdown(sp_coord *c, uv_close_cb closed) {
  struct sp_coord_agents *a = c->agents;
  if (a == NULL) return false;
  bool closing = a->decide_init;
  if (closing) {
    uv_timer_stop(&a->decide);
    a->closed = closed;
    uv_close((uv_handle_t *)&a->decide, decide_closed);
  }
  while (a->list)
    drop_agent(a, a->list, SP_RPC_UNAVAILABLE, "coordinator shutting down");
  return closing;
}

void sp_coord_agents_free(sp_coord *c) {
  struct sp_coord_agents *a = c->agents;
  if (a == NULL) return;
  for (size_t i = 0; i < a->n_rec; i++) free(a->rec[i].reason);
  free(a->rec);
  free(a->end_reason);
  free(a);
  c->agents = NULL;
}
