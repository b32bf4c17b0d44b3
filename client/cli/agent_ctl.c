/* The agent's stream to the coordinator and its outages (agent_ctl.h). */
#include "agent_ctl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/backoff.h"
#include "base/clock.h"
#include "cli.h"
#include "rpc/coord_service.h"

#define AGENT_PATH "/shardplane.v1.Coordinator/AgentSession"

/* Between attempts to register again: an attempt over the proxy waits
 * for the coordinator's connection itself (the proxy's connect timeout),
 * so these only pace the attempts the coordinator refused at once (not
 * listening yet, or shutting down). */
#define BACKOFF_MIN_MS 100u
#define BACKOFF_MAX_MS 2000u

enum { OPENING, UP, AWAY, DONE };

struct sp_agent_ctl {
  sp_rpc_sync *rpc;
  sp_rpc_sync_stream *st; /* NULL between attempts and after the end */
  char *who, *coordinator;
  uint64_t grace_ms;
  uint64_t incarnation; /* as the last attempt said, for messages */
  uint32_t node_rank, nproc, max_restarts, min_nodes, max_nodes;
  char host[256];
  int state;
  bool durable; /* as the coordinator's last command said */
  /* the outage (monotonic seconds) */
  double away_since, retry_at;
  uint64_t backoff_ms, jitter;
  uint32_t outages;
  double longest_s;
};

static int send_register(sp_agent_ctl *c, bool rejoin, uint64_t incarnation,
                         bool stopped) {
  Shardplane__V1__AgentRegister reg = SHARDPLANE__V1__AGENT_REGISTER__INIT;
  reg.node_rank = c->node_rank;
  reg.nproc = c->nproc;
  reg.max_restarts = c->max_restarts;
  reg.min_nodes = c->min_nodes;
  reg.max_nodes = c->max_nodes;
  reg.host = c->host;
  reg.pid = (uint32_t)getpid();
  reg.rejoin = rejoin;
  reg.incarnation = incarnation;
  reg.stopped = stopped;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.register_ = &reg;
  return sp_rpc_sync_stream_send(c->st, &up.base);
}

/* Opens a stream and registers on it. */
static int start_stream(sp_agent_ctl *c, bool rejoin, uint64_t incarnation,
                        bool stopped) {
  int rc = sp_rpc_sync_stream_open(c->rpc, AGENT_PATH, 0, NULL, 0, &c->st);
  if (rc != 0) {
    c->st = NULL;
    return rc;
  }
  rc = send_register(c, rejoin, incarnation, stopped);
  if (rc != 0) {
    sp_rpc_sync_stream_close(c->st);
    c->st = NULL;
  }
  return rc;
}

int sp_agent_ctl_open(const sp_agent_ctl_opts *o, sp_agent_ctl **out,
                      sp_diag *d) {
  sp_agent_ctl *c = calloc(1, sizeof *c);
  if (c == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  c->who = strdup(o->who);
  c->coordinator = strdup(o->coordinator);
  c->grace_ms = o->grace_ms;
  c->node_rank = o->node_rank;
  c->nproc = o->nproc;
  c->max_restarts = o->max_restarts;
  c->min_nodes = o->min_nodes;
  c->max_nodes = o->max_nodes;
  c->jitter = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull;
  if (gethostname(c->host, sizeof c->host) != 0)
    snprintf(c->host, sizeof c->host, "?");
  c->host[sizeof c->host - 1] = '\0';
  int rc = c->coordinator && c->who ? 0 : SP_ENOMEM;
  if (rc == 0) rc = sp_rpc_sync_open_opts(o->target, &o->client, &c->rpc);
  if (rc == 0) rc = start_stream(c, false, 0, false);
  if (rc != 0) {
    sp_agent_ctl_close(c);
    return sp_diag_set(d, rc, "cannot open the %s's stream to %s: %s", o->who,
                       o->coordinator, sp_strerror(rc));
  }
  c->state = OPENING;
  *out = c;
  return 0;
}

static void close_stream(sp_agent_ctl *c) {
  if (c->st == NULL) return;
  sp_rpc_sync_stream_close(c->st);
  c->st = NULL;
}

static void schedule_retry(sp_agent_ctl *c) {
  c->retry_at =
      sp_clock_s() + (double)sp_backoff_next(&c->backoff_ms, BACKOFF_MIN_MS,
                                             BACKOFF_MAX_MS, &c->jitter) /
                         1000.0;
}

static void outage_begin(sp_agent_ctl *c, const char *why) {
  c->state = AWAY;
  c->away_since = sp_clock_s();
  c->backoff_ms = 0;
  schedule_retry(c);
  sp_cli_error(c->who,
               "lost the coordinator at %s (%s); the workers go "
               "on, and this node registers again when it is back (for up "
               "to %.3g s, --coordinator-grace)",
               c->coordinator, why, (double)c->grace_ms / 1000.0);
}

static void outage_end(sp_agent_ctl *c) {
  double s = sp_clock_s() - c->away_since;
  c->outages++;
  if (s > c->longest_s) c->longest_s = s;
  sp_cli_error(c->who,
               "the coordinator at %s is back after %.1f s; "
               "registered again (node %u, incarnation %llu)",
               c->coordinator, s, c->node_rank,
               (unsigned long long)c->incarnation);
}

/* The stream ended as `what` says: an outage begins (or goes on), or the
 * end is final. */
static int stream_ended(sp_agent_ctl *c, const char *what, bool unavailable,
                        sp_diag *d) {
  close_stream(c);
  if (c->state == AWAY && unavailable) {
    schedule_retry(c);
    return 0;
  }
  if (c->state == UP && unavailable && c->durable && c->grace_ms > 0) {
    outage_begin(c, what);
    return 0;
  }
  int was = c->state;
  c->state = DONE;
  if (was == UP && unavailable)
    return sp_diag_set(d, SP_EIO,
                       "lost the coordinator at %s (%s); it "
                       "keeps no state dir (--state-dir), so the job cannot "
                       "outlive it",
                       c->coordinator, what);
  if (was == AWAY)
    return sp_diag_set(d, SP_ENOENT,
                       "the coordinator at %s refused the "
                       "%s's registration after its outage: %s",
                       c->coordinator, c->who, what);
  return sp_diag_set(d, SP_ENOENT,
                     "the coordinator ended the %s's stream: "
                     "%s",
                     c->who, what);
}

int sp_agent_ctl_next(sp_agent_ctl *c, uint64_t wait_ms, uint64_t incarnation,
                      bool stopped, Shardplane__V1__AgentDown **out,
                      sp_diag *d) {
  if (c->state == DONE) return SP_ESTATE;
  if (c->state == AWAY) {
    double now = sp_clock_s();
    if ((now - c->away_since) * 1000.0 >= (double)c->grace_ms) {
      close_stream(c);
      c->state = DONE;
      return sp_diag_set(d, SP_ETIMEDOUT,
                         "the coordinator at %s was "
                         "unreachable for longer than the grace period of "
                         "%.3g s (--coordinator-grace)",
                         c->coordinator, (double)c->grace_ms / 1000.0);
    }
    if (c->st == NULL) {
      if (now < c->retry_at) return 0;
      c->incarnation = incarnation;
      if (start_stream(c, true, incarnation, stopped) != 0) {
        schedule_retry(c);
        return 0;
      }
    }
  }
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  int rc = sp_rpc_sync_stream_recv(
      c->st, &shardplane__v1__agent_down__descriptor, wait_ms, &m, &st);
  if (rc == SP_ETIMEDOUT) return 0;
  if (rc == 0) {
    Shardplane__V1__AgentDown *cmd = (Shardplane__V1__AgentDown *)m;
    if (c->state == AWAY) outage_end(c);
    c->state = UP;
    c->durable = cmd->durable;
    *out = cmd;
    return 1;
  }
  char what[sizeof st.message + 40];
  if (rc == SP_ENOENT)
    snprintf(what, sizeof what, "%s%s%s", sp_rpc_code_name(st.code),
             st.message[0] ? ": " : "", st.message);
  else
    snprintf(what, sizeof what, "%s", sp_strerror(rc));
  /* a message that does not decode is the coordinator's fault, not an
   * outage; a status is one only when it says UNAVAILABLE */
  bool unavailable = rc == SP_ENOENT && st.code == SP_RPC_UNAVAILABLE;
  return stream_ended(c, what, unavailable, d);
}

int sp_agent_ctl_send(sp_agent_ctl *c, const Shardplane__V1__AgentUp *up) {
  if (c == NULL || c->state != UP || c->st == NULL) return SP_ESTATE;
  return sp_rpc_sync_stream_send(c->st, &up->base);
}

int sp_agent_ctl_get_job(sp_agent_ctl *c, uint64_t timeout_ms,
                         Shardplane__V1__GetJobResponse **out) {
  *out = NULL;
  if (!sp_agent_ctl_up(c)) return SP_ESTATE;
  Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  int rc = sp_rpc_sync_unary(c->rpc, SP_COORD_PATH("GetJob"), &q.base,
                             &shardplane__v1__get_job_response__descriptor,
                             timeout_ms, &m, &st);
  if (rc == 0 && st.code == SP_RPC_OK && m != NULL) {
    *out = (Shardplane__V1__GetJobResponse *)m;
    return 0;
  }
  if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
  return rc != 0 ? rc : SP_EIO;
}

bool sp_agent_ctl_up(const sp_agent_ctl *c) {
  return c != NULL && c->state == UP;
}

bool sp_agent_ctl_away(const sp_agent_ctl *c) {
  return c != NULL && c->state == AWAY;
}

void sp_agent_ctl_outages(const sp_agent_ctl *c, uint32_t *n,
                          double *longest_s) {
  *n = c ? c->outages : 0;
  *longest_s = c ? c->longest_s : 0;
}

void sp_agent_ctl_close(sp_agent_ctl *c) {
  if (c == NULL) return;
  if (c->st) sp_rpc_sync_stream_close_send(c->st);
  close_stream(c);
  if (c->rpc) sp_rpc_sync_close(c->rpc);
  free(c->coordinator);
  free(c->who);
  free(c);
}

void sp_agent_ctl_set_node(sp_agent_ctl *c, uint32_t node_rank) {
  c->node_rank = node_rank;
}
