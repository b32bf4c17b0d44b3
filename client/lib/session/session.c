/* The session of one rank (shardplane.h, "Session"): attach, the plan the
 * rank builds itself, the coordinator's store, and reporting. This file
 * opens and closes it; session_store.c has the blocking calls (store and
 * the other unary calls), session_report.c the reporting: the event ring
 * the training thread fills and the background thread that streams it.
 *
 * Threads:
 * - the training thread owns the session: open, close, transitions,
 *   collectives, step, flush;
 * - a background thread runs its own libuv loop with an async gRPC client
 *   that keeps the Session stream: it drains the event queue into SessionUp
 *   messages, sends heartbeats, reads acknowledgements, rejections and
 *   commands (ABORT), and calls opts->on_abort;
 * - any thread may call the store functions: they take a blocking
 *   connection from a small pool, so a thread waiting on a key never holds
 *   up another thread's set (a rendezvous inside one process works).
 *
 * The event queue is a single-producer / single-consumer ring of fixed-size
 * records. The training thread writes a slot and publishes its head with a
 * release store; the background thread reads up to the head (acquire),
 * packs, sends, and publishes its tail. No lock and no syscall per event:
 * the background thread wakes on its own short timer, and the producer
 * pokes it (uv_async_send) only when the ring is half full. A full ring
 * drops the event and counts it.
 *
 * Acknowledgement: each SessionUp carries a seq; the coordinator answers
 * every message with acked_seq. The background thread remembers, per seq in
 * flight, how many events had been sent up to and including it, so "events
 * acknowledged" is a count that flush compares with the producer's head.
 *
 * Timings (session_internal.h): the drain timer runs every 100 ms while
 * events flow and backs off to 200 ms when idle; at most SP_SESSION_BATCH
 * events per message and SP_SESSION_WINDOW data messages unacknowledged. Heartbeats go
 * every min(heartbeat_interval, heartbeat_timeout / 3) as the coordinator
 * gave them at Attach, and only when the stream was quiet for half that.
 *
 * Errors of the background side are sticky: the first one (a rejected
 * transition: SP_ESTATE; the stream ending: the status's code, e.g.
 * SP_ECANCELED for ABORTED; a coordinator away longer than the grace
 * period: SP_ETIMEDOUT) is what every later
 * flush and the close return. A dropped event is not an error, but a
 * dropped *transition* leaves the coordinator one state behind, so it
 * rejects a later one: a queue that overflows shows up as SP_ESTATE.
 *
 * A stream ending UNAVAILABLE (the coordinator died or restarts) is not
 * an error at first: session_report.c reconnects within the grace period
 * and resyncs (docs/architecture.md, "Durability").
 *
 * on_abort runs on the background thread, at most once, for an ABORT
 * command or for the stream ending before sp_session_close began; it must
 * not call sp_session_close (which joins that thread).
 */
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "plan_wire.h"
#include "session_internal.h"
#include "base/strmap.h"

/* ------------------------------------------------------------------ */
/* Helpers                                                             */
/* ------------------------------------------------------------------ */

int sp_session_check_plan_version(const char *local, const char *coordinator,
                                  sp_diag *d) {
  if (local == NULL || coordinator == NULL || local[0] == '\0' ||
      strcmp(local, coordinator) != 0)
    return sp_diag_set(
        d, SP_ESTATE,
        "plan version mismatch: this rank built %s, the "
        "coordinator has %s (another model spec or job)",
        local != NULL && local[0] ? local : "(none)",
        coordinator != NULL && coordinator[0] ? coordinator : "(none)");
  return 0;
}

int sp_session_rpc_error(int code) {
  switch (code) {
    case SP_RPC_OK: return 0;
    case SP_RPC_INVALID_ARGUMENT: return SP_EINVAL;
    case SP_RPC_OUT_OF_RANGE: return SP_ERANGE;
    case SP_RPC_DEADLINE_EXCEEDED: return SP_ETIMEDOUT;
    case SP_RPC_NOT_FOUND: return SP_ENOENT;
    case SP_RPC_ALREADY_EXISTS: return SP_EEXIST;
    /* wrong session id, or a rank that is not attached: this side's idea of
   * the session no longer holds */
    case SP_RPC_PERMISSION_DENIED:
    case SP_RPC_FAILED_PRECONDITION: return SP_ESTATE;
    case SP_RPC_RESOURCE_EXHAUSTED: return SP_ETOOBIG;
    case SP_RPC_CANCELLED:
    case SP_RPC_ABORTED: return SP_ECANCELED;
    case SP_RPC_UNIMPLEMENTED: return SP_EUNSUPPORTED;
    case SP_RPC_UNAUTHENTICATED: return SP_EINVAL;
    default: return SP_EIO; /* UNKNOWN, INTERNAL, UNAVAILABLE, DATA_LOSS */
  }
}

const char *sp_session_id(const sp_session *s) {
  return s != NULL ? s->session_id : NULL;
}

static uint64_t round_pow2(uint64_t v) {
  uint64_t p = 2;
  while (p < v) p <<= 1;
  return p;
}

/* ------------------------------------------------------------------ */
/* Open and close                                                      */
/* ------------------------------------------------------------------ */

static void session_free(sp_session *s) {
  if (s == NULL) return;
  sp_session_bg_stop(s);
  sp_session_pool_close(s);
  if (s->lock_ready) {
    uv_mutex_destroy(&s->lock);
    uv_cond_destroy(&s->cond);
  }
  free(s->tr);
  free(s->trp);
  free(s->co);
  free(s->cop);
  free(s->shadow_units);
  free(s->flight);
  free(s->test_down);
  free(s->last_flight);
  for (int k = 0; k < SP_SESSION_COMMS; k++) free(s->issued[k]);
  free(s->slots);
  sp_state_tracker_free(&s->st);
  sp_plan_free(s->plan);
  sp_model_free(s->model);
  sp_job_clear(&s->job);
  free(s->coordinator);
  free(s->device);
  free(s->session_id);
  sp_session_cred_free(&s->cred);
  free(s);
}

/* A start-up call (GetJob, GetModelSpec, Attach), tried again while the
 * coordinator cannot be reached (it may be restarting: a kill -9 can land
 * in any of them), for connect_timeout_ms in all. A retry of an Attach
 * whose answer was lost is the same process (host and pid) asking again,
 * which the coordinator answers with the same session. */
static int call_retrying(sp_session *s, const char *what, const char *path,
                         const ProtobufCMessage *q,
                         const ProtobufCMessageDescriptor *desc,
                         uint64_t timeout_ms, ProtobufCMessage **m,
                         sp_rpc_status *st, sp_diag *d) {
  uint64_t t0 = uv_hrtime(), base = 0, jitter = t0 ^ s->rank;
  for (;;) {
    int rc = sp_session_unary(s, what, path, q, desc, timeout_ms, m, st, d);
    if (rc == 0 || st->code != SP_RPC_UNAVAILABLE) return rc;
    uint64_t spent = (uv_hrtime() - t0) / 1000000;
    if (spent >= s->connect_timeout_ms) return rc;
    uint64_t delay = sp_session_backoff(&base, &jitter);
    if (delay > s->connect_timeout_ms - spent)
      delay = s->connect_timeout_ms - spent;
    uv_sleep((unsigned)delay);
  }
}

/* GetJob: the job this rank builds its plan from. */
static int fetch_job(sp_session *s, char *version, size_t cap, sp_diag *d) {
  Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  int rc =
      call_retrying(s, "GetJob", SP_COORD_PATH("GetJob"), &q.base,
                    &shardplane__v1__get_job_response__descriptor,
                    s->connect_timeout_ms + s->call_timeout_ms, &m, &st, d);
  if (rc != 0) {
    /* the first call on a fresh connection: UNAVAILABLE means the engine
     * retried for connect_timeout_ms without reaching the coordinator */
    if (st.code == SP_RPC_UNAVAILABLE)
      return sp_diag_set(d, SP_ETIMEDOUT,
                         "coordinator %s unreachable for %" PRIu64 " ms: %s",
                         s->coordinator, s->connect_timeout_ms, st.message);
    return rc;
  }
  Shardplane__V1__GetJobResponse *j = (Shardplane__V1__GetJobResponse *)m;
  if (j->job == NULL) {
    rc = sp_diag_set(d, SP_EFORMAT, "GetJob: the answer carries no job");
  } else if ((rc = sp_wire_job(j->job, &s->job)) != 0) {
    sp_diag_set(d, rc, "GetJob: the job: %s", sp_strerror(rc));
  } else {
    snprintf(version, cap, "%s", j->plan_version ? j->plan_version : "");
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return rc;
}

/* GetModelSpec, piece by piece, then parsed like the coordinator did. */
static int fetch_model(sp_session *s, const char *job_version, sp_diag *d) {
  char *buf = NULL;
  uint64_t total = 0, off = 0;
  char version[64] = "";
  int rc = 0;
  do {
    Shardplane__V1__GetModelSpecRequest q =
        SHARDPLANE__V1__GET_MODEL_SPEC_REQUEST__INIT;
    q.offset = off;
    q.max_bytes = SPEC_PIECE;
    ProtobufCMessage *m = NULL;
    sp_rpc_status st;
    rc =
        call_retrying(s, "GetModelSpec", SP_COORD_PATH("GetModelSpec"), &q.base,
                      &shardplane__v1__get_model_spec_response__descriptor,
                      s->call_timeout_ms, &m, &st, d);
    if (rc != 0) break;
    Shardplane__V1__GetModelSpecResponse *r =
        (Shardplane__V1__GetModelSpecResponse *)m;
    const char *v = r->plan_version ? r->plan_version : "";
    size_t len = r->spec_json.len;
    if (off == 0) {
      /* limits before allocating */
      if (r->total_bytes > SP_MODEL_MAX_FILE_BYTES) {
        rc = sp_diag_set(d, SP_ETOOBIG,
                         "GetModelSpec: a %" PRIu64
                         "-byte spec is over the limit of %u",
                         (uint64_t)r->total_bytes, SP_MODEL_MAX_FILE_BYTES);
      } else if ((buf = malloc(r->total_bytes + 1)) == NULL) {
        rc = sp_diag_set(d, SP_ENOMEM, "out of memory");
      } else {
        total = r->total_bytes;
        snprintf(version, sizeof version, "%s", v);
      }
    } else if (r->total_bytes != total || strcmp(v, version) != 0) {
      rc = sp_diag_set(d, SP_ESTATE,
                       "GetModelSpec: the spec changed while it was read "
                       "(plan %s, then %s): did the coordinator restart?",
                       version, v);
    }
    if (rc == 0 &&
        (r->offset != off || len > total - off || (len == 0 && off < total)))
      rc = sp_diag_set(d, SP_EFORMAT,
                       "GetModelSpec: asked for byte %" PRIu64
                       ", got %zu bytes at %" PRIu64 " of %" PRIu64,
                       off, len, (uint64_t)r->offset, total);
    if (rc == 0) {
      memcpy(buf + off, r->spec_json.data, len);
      off += len;
    }
    protobuf_c_message_free_unpacked(m, NULL);
  } while (rc == 0 && off < total);
  if (rc == 0 && strcmp(version, job_version) != 0)
    rc = sp_diag_set(d, SP_ESTATE,
                     "the coordinator's plan changed between GetJob (%s) and "
                     "GetModelSpec (%s): did it restart?",
                     job_version, version);
  if (rc == 0) {
    char origin[320];
    snprintf(origin, sizeof origin, "model spec from %s", s->coordinator);
    rc = sp_model_load_string(buf, (size_t)total, origin, &s->model, d);
  }
  free(buf);
  return rc;
}

static int attach(sp_session *s, sp_diag *d) {
  char host[256];
  size_t hl = sizeof host;
  if (uv_os_gethostname(host, &hl) != 0) snprintf(host, sizeof host, "?");
  Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  q.rank = s->rank;
  q.world_size = s->world;
  q.host = host;
  q.pid = (uint32_t)uv_os_getpid();
  q.device = s->device;
  q.plan_version = s->plan->version_hex;
  ProtobufCMessage *m = NULL;
  char what[48];
  snprintf(what, sizeof what, "Attach rank %u", s->rank);
  sp_rpc_status st;
  int rc = call_retrying(s, what, SP_COORD_PATH("Attach"), &q.base,
                         &shardplane__v1__attach_response__descriptor,
                         s->call_timeout_ms, &m, &st, d);
  if (rc != 0) return rc;
  Shardplane__V1__AttachResponse *r = (Shardplane__V1__AttachResponse *)m;
  size_t idl = r->session_id ? strlen(r->session_id) : 0;
  if (idl == 0 || idl > 256) {
    rc = sp_diag_set(d, SP_EFORMAT, "Attach: a session id of %zu bytes", idl);
  } else if ((rc = sp_session_check_plan_version(s->plan->version_hex,
                                                 r->plan_version, d)) == 0) {
    s->session_id = sp_strdup(r->session_id);
    if (s->session_id == NULL) rc = sp_diag_set(d, SP_ENOMEM, "out of memory");
    /* beat often enough that two can be missed before the timeout */
    uint32_t hb = r->heartbeat_interval_ms ? r->heartbeat_interval_ms : 1000;
    if (r->heartbeat_timeout_ms > 0 && hb > r->heartbeat_timeout_ms / 3)
      hb = r->heartbeat_timeout_ms / 3;
    s->hb_ms = hb > 0 ? hb : 1;
    /* a coordinator without a state dir forgets the session when it dies:
     * nothing to wait for then */
    if (!r->durable) s->grace_ms = 0;
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return rc;
}

static int detach(sp_session *s, sp_diag *d) {
  Shardplane__V1__DetachRequest q = SHARDPLANE__V1__DETACH_REQUEST__INIT;
  q.rank = s->rank;
  q.session_id = s->session_id;
  char what[48];
  snprintf(what, sizeof what, "Detach rank %u", s->rank);
  return sp_session_unary(s, what, SP_COORD_PATH("Detach"), &q.base,
                          &shardplane__v1__detach_response__descriptor,
                          s->call_timeout_ms, NULL, NULL, d);
}

/* Waits until the coordinator acknowledged the binding message. */
static int wait_bound(sp_session *s, sp_diag *d) {
  uint64_t limit = s->connect_timeout_ms + s->call_timeout_ms;
  uint64_t t0 = uv_hrtime();
  int rc = 0;
  uv_mutex_lock(&s->lock);
  while (!s->bound && !s->stream_done) {
    uint64_t spent = (uv_hrtime() - t0) / 1000000;
    if (spent >= limit) break;
    uv_cond_timedwait(&s->cond, &s->lock, (limit - spent) * 1000000);
  }
  if (!s->bound) {
    if (s->stream_done)
      rc = sp_diag_set(d, s->first_error ? s->first_error : SP_EIO,
                       "rank %u: %s", s->rank, s->first_error_msg);
    else
      rc = sp_diag_set(d, SP_ETIMEDOUT,
                       "rank %u: the coordinator did not acknowledge the "
                       "Session stream within %" PRIu64 " ms",
                       s->rank, limit);
  }
  uv_mutex_unlock(&s->lock);
  return rc;
}

/* A write on a connection the coordinator's death reset must fail with
 * EPIPE, not kill the process: riding out an outage depends on it. Only
 * when the program left SIGPIPE at its default (gRPC C-core does the same
 * at init). */
static void ignore_sigpipe(void) {
  struct sigaction sa;
  if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL &&
      !(sa.sa_flags & SA_SIGINFO))
    signal(SIGPIPE, SIG_IGN);
}

int sp_session_open(const sp_session_opts *o, sp_session **out, sp_diag *d) {
  if (out != NULL) *out = NULL;
  if (o == NULL || out == NULL || o->coordinator == NULL ||
      o->coordinator[0] == '\0')
    return sp_diag_set(d, SP_EINVAL,
                       "session: the coordinator address is "
                       "required");
  char host[256];
  int port;
  /* unix:PATH: the host agent's socket, which proxies to the coordinator */
  if (strncmp(o->coordinator, SP_RPC_UNIX_PREFIX, strlen(SP_RPC_UNIX_PREFIX)) !=
          0 &&
      sp_rpc_split_addr(o->coordinator, host, sizeof host, &port) != 0)
    return sp_diag_set(d, SP_EINVAL,
                       "session: coordinator: expected HOST:PORT or "
                       "unix:PATH, got \"%s\"",
                       o->coordinator);
  uint64_t q =
      o->queue_events ? (uint64_t)o->queue_events : SP_SESSION_QUEUE_DEFAULT;
  if (q > SP_SESSION_QUEUE_MAX)
    return sp_diag_set(d, SP_EINVAL,
                       "session: queue_events %" PRIu64
                       " is over the limit "
                       "of %u",
                       q, SP_SESSION_QUEUE_MAX);
  q = round_pow2(q);
  uint32_t flight =
      o->flight_events ? o->flight_events : SP_SESSION_FLIGHT_DEFAULT;
  if (flight > SP_SESSION_FLIGHT_MAX)
    return sp_diag_set(d, SP_EINVAL,
                       "session: flight_events %u is over the limit of %u",
                       flight, SP_SESSION_FLIGHT_MAX);

  ignore_sigpipe();
  sp_session *s = calloc(1, sizeof *s);
  if (s == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  sp_job_init(&s->job);
  s->rank = o->rank;
  s->no_report = o->no_report;
  s->flight_cap = flight;
  s->on_abort = o->on_abort;
  s->user = o->user;
  s->connect_timeout_ms = o->connect_timeout_ms ? o->connect_timeout_ms : 20000;
  s->call_timeout_ms =
      o->call_timeout_ms ? o->call_timeout_ms : SP_SESSION_CALL_TIMEOUT_MS;
  s->grace_ms = o->coordinator_grace_ms ? o->coordinator_grace_ms
                                        : SP_SESSION_GRACE_DEFAULT_MS;
  s->coordinator = sp_strdup(o->coordinator);
  s->device = sp_strdup(o->device != NULL ? o->device : "cpu");
  s->slots = calloc((size_t)q, sizeof *s->slots);
  int rc = sp_session_cred_copy(&s->cred, o, d);
  if (rc != 0) goto fail;
  if (s->coordinator == NULL || s->device == NULL || s->slots == NULL) {
    rc = sp_diag_set(d, SP_ENOMEM, "out of memory");
    goto fail;
  }
  s->mask = q - 1;
  s->half_check = q / 2;
  if (uv_mutex_init(&s->lock) != 0 || uv_cond_init(&s->cond) != 0) {
    rc = sp_diag_set(d, SP_EIO, "cannot create a lock");
    goto fail;
  }
  s->lock_ready = true;
  if ((rc = sp_session_pool_init(s, d)) != 0) goto fail;

  /* job, spec, plan: everything the coordinator's plan came from */
  char job_version[64] = "";
  if ((rc = fetch_job(s, job_version, sizeof job_version, d)) != 0) goto fail;
  s->world = s->job.world_size;
  if (s->rank >= s->world) {
    rc = sp_diag_set(d, SP_EINVAL,
                     "rank %u is out of range: the job has ranks 0-%u", s->rank,
                     s->world - 1);
    goto fail;
  }
  if ((rc = fetch_model(s, job_version, d)) != 0) goto fail;
  if ((rc = sp_plan_build(s->model, &s->job, &s->plan, d)) != 0) {
    sp_diag_prefix(d, rc, "rank %u: building the plan", s->rank);
    goto fail;
  }
  if ((rc = sp_session_check_plan_version(s->plan->version_hex, job_version,
                                          d)) != 0)
    goto fail;
  if ((rc = sp_state_tracker_init(&s->st, s->plan->n_units, d)) != 0) goto fail;
  for (int m = 0; m < 2; m++)
    for (int f = 0; f < 8; f++)
      for (int t = 0; t < 8; t++)
        s->legal[m][f][t] =
            (uint8_t)sp_state_transition_legal((sp_machine)m, f, t);
  /* the groups of HYBRID_SHARD (fsdp_comms_open makes them the same way) */
  uint32_t sw = s->plan->shard_world ? s->plan->shard_world : 1;
  s->comm_index[SP_COMM_WORLD] = 0;
  s->comm_index[SP_COMM_SHARD] = s->rank / sw;
  s->comm_index[SP_COMM_REPLICA] = s->rank % sw;

  if ((rc = attach(s, d)) != 0) goto fail;
  if ((rc = sp_session_bg_start(s, d)) != 0 || (rc = wait_bound(s, d)) != 0) {
    /* attached but not streaming: give the rank back */
    atomic_store(&s->closing, true);
    sp_diag ignored;
    detach(s, &ignored);
    goto fail;
  }
  *out = s;
  return 0;
fail:
  session_free(s);
  return rc;
}

int sp_session_close(sp_session *s, uint64_t timeout_ms, sp_diag *d) {
  if (s == NULL) return 0;
  sp_diag fd = {""}, dd = {""};
  int rc_flush = sp_session_flush(s, timeout_ms ? timeout_ms : 5000, &fd);
  atomic_store(&s->closing, true);
  uv_mutex_lock(&s->lock);
  bool stream_done = s->stream_done;
  uv_mutex_unlock(&s->lock);
  /* a stream that ended already had the coordinator mark the rank lost:
   * nothing is left to detach */
  int rc_detach = stream_done ? 0 : detach(s, &dd);
  sp_session_bg_stop(s);
  int rc;
  uv_mutex_lock(&s->lock);
  if (s->first_error != 0) {
    rc = sp_diag_set(d, s->first_error, "rank %u: %s", s->rank,
                     s->first_error_msg);
  } else if (rc_flush != 0) {
    rc = sp_diag_set(d, rc_flush, "%s", fd.msg);
  } else if (rc_detach != 0) {
    rc = sp_diag_set(d, rc_detach, "%s", dd.msg);
  } else {
    rc = 0;
  }
  uv_mutex_unlock(&s->lock);
  session_free(s);
  return rc;
}

const sp_plan *sp_session_plan(const sp_session *s) {
  return s ? s->plan : NULL;
}
const sp_model *sp_session_model(const sp_session *s) {
  return s ? s->model : NULL;
}
const sp_job *sp_session_job(const sp_session *s) { return s ? &s->job : NULL; }
uint32_t sp_session_rank(const sp_session *s) { return s ? s->rank : 0; }
uint32_t sp_session_world(const sp_session *s) { return s ? s->world : 0; }
const char *sp_session_coordinator(const sp_session *s) {
  return s ? s->coordinator : NULL;
}
const char *sp_session_device(const sp_session *s) {
  return s ? s->device : NULL;
}
