/* The session of one rank (shardplane.h, "Session"): attach, the plan the
 * rank builds itself, the coordinator's store, and reporting.
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
 * SP_ECANCELED for ABORTED, SP_EIO for UNAVAILABLE) is what every later
 * flush and the close return. A dropped event is not an error, but a
 * dropped *transition* leaves the coordinator one state behind, so it
 * rejects a later one: a queue that overflows shows up as SP_ESTATE.
 *
 * on_abort runs on the background thread, at most once, for an ABORT
 * command or for the stream ending before sp_session_close began; it must
 * not call sp_session_close (which joins that thread).
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "plan_wire.h"
#include "rpc.h"
#include "session_internal.h"
#include "shardplane.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "strmap.h"

#define SERVICE "shardplane.v1.Coordinator"
#define METHOD(m) "/" SERVICE "/" m

/* SessionUp messages in flight: data batches plus heartbeats. */
#define FIFO_CAP (2 * SP_SESSION_WINDOW)
/* Spec pieces asked of GetModelSpec (the coordinator may answer less). */
#define SPEC_PIECE (1u << 20)
/* Messages the background side keeps: a gRPC status message with words
 * around it. */
#define ERRMSG_MAX (SP_RPC_STATUS_MESSAGE_MAX + 128)
/* How much of a store key goes into a message. */
#define KEY_SHOWN 64

enum { EV_TRANSITION = 1, EV_COLLECTIVE = 2 };

/* One queued event; 24 bytes. */
typedef struct sp_sess_event {
  uint64_t a;     /* transition: step; collective: seq */
  uint64_t count; /* collective: elements */
  uint32_t unit;
  uint8_t kind;
  uint8_t x; /* machine or op */
  uint8_t y; /* state or dtype */
} sp_sess_event;

typedef struct inflight {
  uint64_t seq;
  uint64_t end; /* events sent up to and including this message */
  bool data;    /* counts against the data window */
} inflight;

/* Cache-line padding between fields written by different threads: the
 * producer's head and the consumer's tail must not share a line. Arrays
 * rather than alignas, because the struct comes from calloc (16-byte
 * alignment), where an over-aligned type would be undefined. */
#define PAD(n) char pad_##n[64]

struct sp_session {
  /* ---- training thread (producer) ---- */
  sp_sess_event *slots;
  uint64_t mask;       /* ring capacity - 1 */
  uint64_t head_local; /* next slot to fill */
  uint64_t tail_cache; /* the consumer's tail as last read */
  uint64_t half_check; /* head at which to look for a half-full ring */
  uint64_t dropped_local;
  uint64_t step_local;
  uint64_t coll_seq;
  sp_state_tracker st;
  /* legal[m][from][to]: the shared state table as a lookup, so the check
   * on the hot path is one load */
  uint8_t legal[2][8][8];
  bool no_report;
  PAD(0);
  _Atomic uint64_t head; /* published by the producer */
  _Atomic uint64_t dropped;
  _Atomic uint64_t step;
  PAD(1);
  _Atomic uint64_t tail; /* published by the consumer */
  PAD(2);

  /* ---- set by open, read-only afterwards ---- */
  uint32_t rank, world;
  char *coordinator, *device, *session_id;
  sp_model *model;
  sp_job job;
  sp_plan *plan;
  uint64_t connect_timeout_ms, call_timeout_ms;
  uint32_t hb_ms;
  void (*on_abort)(void *, const char *);
  void *user;

  /* ---- shared between threads, under lock ---- */
  uv_mutex_t lock;
  uv_cond_t cond;
  bool lock_ready;
  uint64_t acked_events;
  bool bound, stream_done;
  int first_error;
  char first_error_msg[ERRMSG_MAX];
  char abort_reason[ERRMSG_MAX];
  uint64_t rejections;
  _Atomic bool aborted;
  _Atomic bool abort_called;
  _Atomic bool closing; /* no abort for the stream ending from now on */
  _Atomic bool stop;    /* the background thread should wind down */

  /* ---- store connections ---- */
  uv_mutex_t pool_lock;
  uv_cond_t pool_cond;
  bool pool_ready;
  sp_rpc_sync *pool_free[SP_SESSION_STORE_CONNS];
  size_t n_free, n_open;

  /* ---- background thread ---- */
  uv_loop_t loop;
  bool loop_ready, thread_started;
  uv_thread_t thread;
  uv_async_t wake;
  uv_timer_t drain_timer, hb_timer;
  sp_rpc_client *cl;
  sp_rpc_ccall *call; /* the Session stream; NULL once it ended */
  uint64_t next_seq;
  uint64_t tail_local;
  inflight fifo[FIFO_CAP];
  size_t fifo_first, fifo_n, data_inflight;
  uint64_t drain_delay;
  uint64_t last_send_ms;
  Shardplane__V1__Transition *tr;
  Shardplane__V1__Transition **trp;
  Shardplane__V1__Collective *co;
  Shardplane__V1__Collective **cop;
};

/* ------------------------------------------------------------------ */
/* Helpers                                                             */
/* ------------------------------------------------------------------ */

int sp_session_check_plan_version(const char *local, const char *coordinator,
                                  sp_diag *d) {
  if (local == NULL || coordinator == NULL || local[0] == '\0' ||
      strcmp(local, coordinator) != 0)
    return sp_diag_set(d, SP_ESTATE,
                       "plan version mismatch: this rank built %s, the "
                       "coordinator has %s (another model spec or job)",
                       local != NULL && local[0] ? local : "(none)",
                       coordinator != NULL && coordinator[0] ? coordinator
                                                             : "(none)");
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

/* Records the first error of the background side (under lock). */
static void set_first_error_locked(sp_session *s, int err, const char *msg) {
  if (s->first_error != 0) return;
  s->first_error = err;
  snprintf(s->first_error_msg, sizeof s->first_error_msg, "%s", msg);
}

/* Marks the session aborted and calls on_abort, once. Never under lock:
 * the callback may ask sp_session_aborted. */
static void trigger_abort(sp_session *s, const char *reason) {
  uv_mutex_lock(&s->lock);
  if (!atomic_load(&s->aborted)) {
    snprintf(s->abort_reason, sizeof s->abort_reason, "%s", reason);
    atomic_store(&s->aborted, true);
  }
  uv_mutex_unlock(&s->lock);
  if (!atomic_exchange(&s->abort_called, true) && s->on_abort != NULL)
    s->on_abort(s->user, reason);
}

/* ------------------------------------------------------------------ */
/* Blocking calls: a pool of connections                               */
/* ------------------------------------------------------------------ */

static int pool_get(sp_session *s, sp_rpc_sync **out, sp_diag *d) {
  uv_mutex_lock(&s->pool_lock);
  while (s->n_free == 0 && s->n_open >= SP_SESSION_STORE_CONNS)
    uv_cond_wait(&s->pool_cond, &s->pool_lock);
  if (s->n_free > 0) {
    *out = s->pool_free[--s->n_free];
    uv_mutex_unlock(&s->pool_lock);
    return 0;
  }
  s->n_open++;
  uv_mutex_unlock(&s->pool_lock);
  /* connecting happens on the first call; this only allocates */
  int rc = sp_rpc_sync_open(s->coordinator, s->connect_timeout_ms, out);
  if (rc != 0) {
    uv_mutex_lock(&s->pool_lock);
    s->n_open--;
    uv_cond_signal(&s->pool_cond);
    uv_mutex_unlock(&s->pool_lock);
    return sp_diag_set(d, rc, "cannot open a connection to %s: %s",
                       s->coordinator, sp_strerror(rc));
  }
  return 0;
}

static void pool_put(sp_session *s, sp_rpc_sync *c) {
  uv_mutex_lock(&s->pool_lock);
  s->pool_free[s->n_free++] = c;
  uv_cond_broadcast(&s->pool_cond);
  uv_mutex_unlock(&s->pool_lock);
}

/* One unary call on a pooled connection. Returns 0 with *resp set (when
 * desc is given), or the SP_E* code of the status with "what: CODE:
 * message" in d; *st (optional) gets the status either way. */
static int unary(sp_session *s, const char *what, const char *path,
                 const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *desc, uint64_t timeout_ms,
                 ProtobufCMessage **resp, sp_rpc_status *st_out, sp_diag *d) {
  if (st_out != NULL) {
    st_out->code = SP_RPC_UNKNOWN; /* no call made */
    st_out->message[0] = '\0';
  }
  sp_rpc_sync *c;
  int rc = pool_get(s, &c, d);
  if (rc != 0) return rc;
  sp_rpc_status st = {0};
  ProtobufCMessage *r = NULL;
  rc = sp_rpc_sync_unary(c, path, req, desc, timeout_ms, &r, &st);
  pool_put(s, c);
  if (st_out != NULL) *st_out = st;
  if (rc != 0) return sp_diag_set(d, rc, "%s: %s", what, sp_strerror(rc));
  if (st.code != SP_RPC_OK)
    return sp_diag_set(d, sp_session_rpc_error(st.code), "%s: %s: %s", what,
                       sp_rpc_code_name(st.code),
                       st.message[0] ? st.message : "(no message)");
  if (desc != NULL && r == NULL)
    return sp_diag_set(d, SP_EFORMAT, "%s: the answer does not decode", what);
  if (resp != NULL)
    *resp = r;
  else if (r != NULL)
    protobuf_c_message_free_unpacked(r, NULL);
  return 0;
}

/* ------------------------------------------------------------------ */
/* Background thread: the Session stream                               */
/* ------------------------------------------------------------------ */

static void stream_fail(sp_session *s, const char *why);

static void fifo_push(sp_session *s, uint64_t seq, uint64_t end, bool data) {
  inflight *f = &s->fifo[(s->fifo_first + s->fifo_n) % FIFO_CAP];
  *f = (inflight){seq, end, data};
  s->fifo_n++;
  if (data) s->data_inflight++;
}

/* Sends one SessionUp with events [tail_local, tail_local + n). */
static int send_up(sp_session *s, size_t n) {
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.seq = s->next_seq;
  up.step = atomic_load_explicit(&s->step, memory_order_relaxed);
  if (up.seq == 1) {
    /* the first message binds the stream to the rank */
    up.rank = s->rank;
    up.session_id = s->session_id;
  }
  size_t nt = 0, nc = 0;
  for (size_t i = 0; i < n; i++) {
    const sp_sess_event *e = &s->slots[(s->tail_local + i) & s->mask];
    if (e->kind == EV_TRANSITION) {
      Shardplane__V1__Transition *t = &s->tr[nt];
      t->machine = (Shardplane__V1__Machine)e->x;
      t->unit = e->unit;
      t->state = e->y;
      t->step = e->a;
      s->trp[nt++] = t;
    } else {
      Shardplane__V1__Collective *c = &s->co[nc];
      c->seq = e->a;
      c->op = (Shardplane__V1__CollectiveOp)e->x;
      c->unit = e->unit;
      c->dtype = (Shardplane__V1__DType)e->y;
      c->count = e->count;
      s->cop[nc++] = c;
    }
  }
  up.n_transitions = nt;
  up.transitions = s->trp;
  up.n_collectives = nc;
  up.collectives = s->cop;
  /* packs at once: the arrays are free again when this returns */
  int rc = sp_rpc_ccall_send_msg(s->call, &up.base);
  if (rc != 0) return rc;
  s->next_seq++;
  uv_update_time(&s->loop); /* the first send runs before the loop does */
  s->last_send_ms = uv_now(&s->loop);
  fifo_push(s, up.seq, s->tail_local + n, n > 0);
  return 0;
}

/* Moves queued events into messages while the window allows. Returns
 * whether anything was sent. */
static bool drain(sp_session *s) {
  bool sent = false;
  while (s->call != NULL) {
    uint64_t h = atomic_load_explicit(&s->head, memory_order_acquire);
    uint64_t avail = h - s->tail_local;
    if (avail == 0 || s->data_inflight >= SP_SESSION_WINDOW ||
        s->fifo_n >= FIFO_CAP)
      break;
    size_t n = avail < SP_SESSION_BATCH ? (size_t)avail : SP_SESSION_BATCH;
    int rc = send_up(s, n);
    if (rc != 0) {
      char why[128];
      snprintf(why, sizeof why, "cannot send on the Session stream: %s",
               sp_strerror(rc));
      stream_fail(s, why);
      break;
    }
    s->tail_local += n;
    atomic_store_explicit(&s->tail, s->tail_local, memory_order_release);
    sent = true;
  }
  if (s->call == NULL) {
    /* nobody will send them: free the ring so the producer does not count
     * drops for a stream that is gone (flush reports the stream's error) */
    s->tail_local = atomic_load_explicit(&s->head, memory_order_acquire);
    atomic_store_explicit(&s->tail, s->tail_local, memory_order_release);
  }
  return sent;
}

static void on_drain_timer(uv_timer_t *t) {
  sp_session *s = t->data;
  bool sent = drain(s);
  /* SP_SESSION_DRAIN_MS while events flow; back off when idle */
  if (sent)
    s->drain_delay = SP_SESSION_DRAIN_MS;
  else if (s->drain_delay < SP_SESSION_DRAIN_IDLE_MS)
    s->drain_delay *= 2;
  uv_update_time(&s->loop); /* from now, after the drain's own work */
  uv_timer_start(t, on_drain_timer, s->drain_delay, 0);
}

static void on_hb_timer(uv_timer_t *t) {
  sp_session *s = t->data;
  if (s->call == NULL) return;
  /* any message counts as a heartbeat; send an empty one only when the
   * stream has been quiet for half an interval */
  uv_update_time(&s->loop);
  if (uv_now(&s->loop) - s->last_send_ms < s->hb_ms / 2) return;
  if (s->fifo_n >= FIFO_CAP) return; /* the coordinator is not reading */
  int rc = send_up(s, 0);
  if (rc != 0) {
    char why[128];
    snprintf(why, sizeof why, "cannot send a heartbeat: %s", sp_strerror(rc));
    stream_fail(s, why);
  }
}

static void on_acked(sp_session *s, uint64_t seq) {
  bool any = false;
  uint64_t end = 0;
  while (s->fifo_n > 0 && s->fifo[s->fifo_first].seq <= seq) {
    inflight *f = &s->fifo[s->fifo_first];
    end = f->end;
    if (f->data) s->data_inflight--;
    s->fifo_first = (s->fifo_first + 1) % FIFO_CAP;
    s->fifo_n--;
    any = true;
  }
  if (!any) return;
  uv_mutex_lock(&s->lock);
  if (end > s->acked_events) s->acked_events = end;
  s->bound = true; /* seq 1, the binding message, is always first */
  uv_cond_broadcast(&s->cond);
  uv_mutex_unlock(&s->lock);
}

static void session_msg(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                        void *user) {
  (void)call;
  sp_session *s = user;
  Shardplane__V1__SessionDown *m =
      shardplane__v1__session_down__unpack(NULL, len, data);
  if (m == NULL) {
    stream_fail(s, "the coordinator sent an undecodable SessionDown");
    return;
  }
  if (m->n_rejections > 0) {
    char msg[SP_DIAG_MAX];
    const Shardplane__V1__Rejection *r = m->rejections[0];
    snprintf(msg, sizeof msg, "the coordinator rejected a transition: %s",
             r->reason != NULL && r->reason[0] ? r->reason : "(no reason)");
    uv_mutex_lock(&s->lock);
    s->rejections += m->n_rejections;
    set_first_error_locked(s, SP_ESTATE, msg);
    uv_mutex_unlock(&s->lock);
  }
  on_acked(s, m->acked_seq);
  if (m->command == SHARDPLANE__V1__COMMAND__ABORT) {
    char reason[SP_DIAG_MAX];
    snprintf(reason, sizeof reason, "the coordinator sent ABORT: %s",
             m->reason != NULL && m->reason[0] ? m->reason : "(no reason)");
    trigger_abort(s, reason);
  }
  shardplane__v1__session_down__free_unpacked(m, NULL);
  /* acknowledgements open the window */
  if (s->call != NULL) drain(s);
}

static void session_close(sp_rpc_ccall *call, const sp_rpc_status *st,
                          void *user) {
  (void)call;
  sp_session *s = user;
  s->call = NULL;
  bool closing = atomic_load(&s->closing);
  char msg[ERRMSG_MAX - 32];
  snprintf(msg, sizeof msg, "the Session stream ended: %s: %s",
           sp_rpc_code_name(st->code),
           st->message[0] ? st->message : "(no message)");
  uv_mutex_lock(&s->lock);
  bool was_bound = s->bound;
  s->stream_done = true;
  if (!closing) {
    int err = sp_session_rpc_error(st->code);
    set_first_error_locked(s, err != 0 ? err : SP_EIO, msg);
  }
  uv_cond_broadcast(&s->cond);
  uv_mutex_unlock(&s->lock);
  /* before binding, open reports the failure instead */
  if (!closing && was_bound) trigger_abort(s, msg);
}

static const sp_rpc_ccall_cbs k_session_cbs = {session_msg, session_close};

/* Ends the stream from this side; session_close records why. */
static void stream_fail(sp_session *s, const char *why) {
  uv_mutex_lock(&s->lock);
  set_first_error_locked(s, SP_EIO, why);
  uv_mutex_unlock(&s->lock);
  if (s->call != NULL) sp_rpc_ccall_cancel(s->call);
}

static void on_wake(uv_async_t *a) {
  sp_session *s = a->data;
  if (!atomic_load(&s->stop)) {
    drain(s);
    return;
  }
  /* wind down: closing the client cancels the stream (session_close runs,
   * quietly, since closing is set), then every handle goes */
  if (s->cl != NULL) {
    sp_rpc_client_close(s->cl, NULL, NULL);
    s->cl = NULL;
  }
  uv_timer_stop(&s->drain_timer);
  uv_timer_stop(&s->hb_timer);
  uv_close((uv_handle_t *)&s->drain_timer, NULL);
  uv_close((uv_handle_t *)&s->hb_timer, NULL);
  uv_close((uv_handle_t *)&s->wake, NULL);
}

static void bg_main(void *arg) {
  sp_session *s = arg;
  uv_run(&s->loop, UV_RUN_DEFAULT);
}

/* Sets up the loop, the client, the stream with its binding message and the
 * timers, then starts the thread. On failure everything it made is gone. */
static int bg_start(sp_session *s, sp_diag *d) {
  size_t b = SP_SESSION_BATCH;
  s->tr = calloc(b, sizeof *s->tr);
  s->trp = calloc(b, sizeof *s->trp);
  s->co = calloc(b, sizeof *s->co);
  s->cop = calloc(b, sizeof *s->cop);
  if (s->tr == NULL || s->trp == NULL || s->co == NULL || s->cop == NULL)
    return sp_diag_set(d, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < b; i++) {
    shardplane__v1__transition__init(&s->tr[i]);
    shardplane__v1__collective__init(&s->co[i]);
  }
  if (uv_loop_init(&s->loop) != 0)
    return sp_diag_set(d, SP_EIO, "cannot create the session's event loop");
  s->loop_ready = true;
  sp_rpc_client_opts co = {.connect_timeout_ms = s->connect_timeout_ms};
  int rc = sp_rpc_client_new(&s->loop, s->coordinator, &co, &s->cl);
  if (rc != 0) {
    uv_loop_close(&s->loop);
    s->loop_ready = false;
    return sp_diag_set(d, rc, "cannot create the Session client: %s",
                       sp_strerror(rc));
  }
  uv_async_init(&s->loop, &s->wake, on_wake);
  uv_timer_init(&s->loop, &s->drain_timer);
  uv_timer_init(&s->loop, &s->hb_timer);
  s->wake.data = s->drain_timer.data = s->hb_timer.data = s;
  s->next_seq = 1;
  rc = sp_rpc_client_start(s->cl, METHOD("Session"), NULL, 0, 0,
                           &k_session_cbs, s, &s->call);
  if (rc == 0 && s->call != NULL) rc = send_up(s, 0);
  if (rc != 0 || s->call == NULL) {
    rc = sp_diag_set(d, rc ? rc : SP_EIO, "cannot start the Session stream: %s",
                     rc ? sp_strerror(rc) : "ended at once");
    goto fail_handles;
  }
  s->drain_delay = SP_SESSION_DRAIN_MS;
  uv_update_time(&s->loop); /* the loop has not run yet */
  uv_timer_start(&s->drain_timer, on_drain_timer, s->drain_delay, 0);
  uv_timer_start(&s->hb_timer, on_hb_timer, s->hb_ms, s->hb_ms);
  if (uv_thread_create(&s->thread, bg_main, s) != 0) {
    rc = sp_diag_set(d, SP_EIO, "cannot start the session thread");
    goto fail_handles;
  }
  s->thread_started = true;
  return 0;

fail_handles:
  atomic_store(&s->closing, true);
  atomic_store(&s->stop, true);
  on_wake(&s->wake); /* the same wind-down, run here */
  uv_run(&s->loop, UV_RUN_DEFAULT);
  uv_loop_close(&s->loop);
  s->loop_ready = false;
  return rc;
}

static void bg_stop(sp_session *s) {
  if (!s->thread_started) return;
  atomic_store(&s->stop, true);
  uv_async_send(&s->wake);
  uv_thread_join(&s->thread);
  s->thread_started = false;
  /* anything a callback left (a uv_stop) ends here */
  while (uv_run(&s->loop, UV_RUN_DEFAULT) != 0) {
  }
  uv_loop_close(&s->loop);
  s->loop_ready = false;
}

/* ------------------------------------------------------------------ */
/* Open and close                                                      */
/* ------------------------------------------------------------------ */

static void session_free(sp_session *s) {
  if (s == NULL) return;
  bg_stop(s);
  if (s->pool_ready) {
    /* a store call still running on another thread returns its
     * connection first (the caller must not start new ones now) */
    uv_mutex_lock(&s->pool_lock);
    while (s->n_free < s->n_open) uv_cond_wait(&s->pool_cond, &s->pool_lock);
    uv_mutex_unlock(&s->pool_lock);
    for (size_t i = 0; i < s->n_free; i++) sp_rpc_sync_close(s->pool_free[i]);
    uv_mutex_destroy(&s->pool_lock);
    uv_cond_destroy(&s->pool_cond);
  }
  if (s->lock_ready) {
    uv_mutex_destroy(&s->lock);
    uv_cond_destroy(&s->cond);
  }
  free(s->tr);
  free(s->trp);
  free(s->co);
  free(s->cop);
  free(s->slots);
  sp_state_tracker_free(&s->st);
  sp_plan_free(s->plan);
  sp_model_free(s->model);
  sp_job_clear(&s->job);
  free(s->coordinator);
  free(s->device);
  free(s->session_id);
  free(s);
}

/* GetJob: the job this rank builds its plan from. */
static int fetch_job(sp_session *s, char *version, size_t cap, sp_diag *d) {
  Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  int rc = unary(s, "GetJob", METHOD("GetJob"), &q.base,
                 &shardplane__v1__get_job_response__descriptor,
                 s->connect_timeout_ms + s->call_timeout_ms, &m, &st,
                 d);
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
    rc = unary(s, "GetModelSpec", METHOD("GetModelSpec"), &q.base,
               &shardplane__v1__get_model_spec_response__descriptor,
               s->call_timeout_ms, &m, NULL, d);
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
    if (rc == 0 && (r->offset != off || len > total - off ||
                    (len == 0 && off < total)))
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
  int rc = unary(s, what, METHOD("Attach"), &q.base,
                 &shardplane__v1__attach_response__descriptor,
                 s->call_timeout_ms, &m, NULL, d);
  if (rc != 0) return rc;
  Shardplane__V1__AttachResponse *r = (Shardplane__V1__AttachResponse *)m;
  size_t idl = r->session_id ? strlen(r->session_id) : 0;
  if (idl == 0 || idl > 256) {
    rc = sp_diag_set(d, SP_EFORMAT, "Attach: a session id of %zu bytes", idl);
  } else if ((rc = sp_session_check_plan_version(
                  s->plan->version_hex, r->plan_version, d)) == 0) {
    s->session_id = sp_strdup(r->session_id);
    if (s->session_id == NULL) rc = sp_diag_set(d, SP_ENOMEM, "out of memory");
    /* beat often enough that two can be missed before the timeout */
    uint32_t hb = r->heartbeat_interval_ms ? r->heartbeat_interval_ms : 1000;
    if (r->heartbeat_timeout_ms > 0 && hb > r->heartbeat_timeout_ms / 3)
      hb = r->heartbeat_timeout_ms / 3;
    s->hb_ms = hb > 0 ? hb : 1;
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
  return unary(s, what, METHOD("Detach"), &q.base,
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

int sp_session_open(const sp_session_opts *o, sp_session **out, sp_diag *d) {
  if (out != NULL) *out = NULL;
  if (o == NULL || out == NULL || o->coordinator == NULL ||
      o->coordinator[0] == '\0')
    return sp_diag_set(d, SP_EINVAL, "session: the coordinator address is "
                                     "required");
  char host[256];
  int port;
  if (sp_rpc_split_addr(o->coordinator, host, sizeof host, &port) != 0)
    return sp_diag_set(d, SP_EINVAL,
                       "session: coordinator: expected HOST:PORT, got \"%s\"",
                       o->coordinator);
  uint64_t q = o->queue_events ? (uint64_t)o->queue_events
                               : SP_SESSION_QUEUE_DEFAULT;
  if (q > SP_SESSION_QUEUE_MAX)
    return sp_diag_set(d, SP_EINVAL,
                       "session: queue_events %" PRIu64 " is over the limit "
                       "of %u",
                       q, SP_SESSION_QUEUE_MAX);
  q = round_pow2(q);

  sp_session *s = calloc(1, sizeof *s);
  if (s == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  sp_job_init(&s->job);
  s->rank = o->rank;
  s->no_report = o->no_report;
  s->on_abort = o->on_abort;
  s->user = o->user;
  s->connect_timeout_ms = o->connect_timeout_ms ? o->connect_timeout_ms : 20000;
  s->call_timeout_ms =
      o->call_timeout_ms ? o->call_timeout_ms : SP_SESSION_CALL_TIMEOUT_MS;
  s->coordinator = sp_strdup(o->coordinator);
  s->device = sp_strdup(o->device != NULL ? o->device : "cpu");
  s->slots = calloc((size_t)q, sizeof *s->slots);
  int rc = 0;
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
  if (uv_mutex_init(&s->pool_lock) != 0 || uv_cond_init(&s->pool_cond) != 0) {
    rc = sp_diag_set(d, SP_EIO, "cannot create a lock");
    goto fail;
  }
  s->pool_ready = true;

  /* job, spec, plan: everything the coordinator's plan came from */
  char job_version[64] = "";
  if ((rc = fetch_job(s, job_version, sizeof job_version, d)) != 0) goto fail;
  s->world = s->job.world_size;
  if (s->rank >= s->world) {
    rc = sp_diag_set(d, SP_EINVAL,
                     "rank %u is out of range: the job has ranks 0-%u",
                     s->rank, s->world - 1);
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
  if ((rc = sp_state_tracker_init(&s->st, s->plan->n_units, d)) != 0)
    goto fail;
  for (int m = 0; m < 2; m++)
    for (int f = 0; f < 8; f++)
      for (int t = 0; t < 8; t++)
        s->legal[m][f][t] =
            (uint8_t)sp_state_transition_legal((sp_machine)m, f, t);

  if ((rc = attach(s, d)) != 0) goto fail;
  if ((rc = bg_start(s, d)) != 0 || (rc = wait_bound(s, d)) != 0) {
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
  bg_stop(s);
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
const sp_job *sp_session_job(const sp_session *s) {
  return s ? &s->job : NULL;
}
uint32_t sp_session_rank(const sp_session *s) { return s ? s->rank : 0; }
uint32_t sp_session_world(const sp_session *s) { return s ? s->world : 0; }
const char *sp_session_coordinator(const sp_session *s) {
  return s ? s->coordinator : NULL;
}
const char *sp_session_device(const sp_session *s) {
  return s ? s->device : NULL;
}

/* ------------------------------------------------------------------ */
/* Store                                                               */
/* ------------------------------------------------------------------ */

static int check_key(const char *op, const char *key, sp_diag *d) {
  if (key == NULL || key[0] == '\0')
    return sp_diag_set(d, SP_EINVAL, "store %s: a key is required", op);
  size_t n = strlen(key);
  if (n > SP_SESSION_STORE_MAX_KEY)
    return sp_diag_set(d, SP_ETOOBIG,
                       "store %s: a %zu-byte key is over the limit of %u", op,
                       n, SP_SESSION_STORE_MAX_KEY);
  return 0;
}

int sp_session_store_set(sp_session *s, const char *key, const void *val,
                         size_t len, sp_diag *d) {
  if (s == NULL || (val == NULL && len > 0))
    return sp_diag_set(d, SP_EINVAL, "store set: bad arguments");
  int rc = check_key("set", key, d);
  if (rc != 0) return rc;
  if (len > SP_SESSION_STORE_MAX_VALUE)
    return sp_diag_set(d, SP_ETOOBIG,
                       "store set \"%.*s\": a %zu-byte value is over the "
                       "limit of %u",
                       KEY_SHOWN, key, len, SP_SESSION_STORE_MAX_VALUE);
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.value.data = (uint8_t *)val;
  q.value.len = len;
  char what[96];
  snprintf(what, sizeof what, "store set \"%.*s\"", KEY_SHOWN, key);
  return unary(s, what, METHOD("StoreSet"), &q.base,
               &shardplane__v1__store_set_response__descriptor,
               s->call_timeout_ms, NULL, NULL, d);
}

int sp_session_store_get(sp_session *s, const char *key, uint64_t wait_ms,
                         uint8_t **val, size_t *len, sp_diag *d) {
  if (s == NULL || val == NULL || len == NULL)
    return sp_diag_set(d, SP_EINVAL, "store get: bad arguments");
  *val = NULL;
  *len = 0;
  int rc = check_key("get", key, d);
  if (rc != 0) return rc;
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  /* waiting is the coordinator's: the call's deadline ends it */
  q.wait = wait_ms > 0;
  char what[96];
  snprintf(what, sizeof what, "store get \"%.*s\"", KEY_SHOWN, key);
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  rc = unary(s, what, METHOD("StoreGet"), &q.base,
             &shardplane__v1__store_get_response__descriptor,
             wait_ms > 0 ? wait_ms : s->call_timeout_ms, &m, &st, d);
  if (rc != 0) {
    if (st.code == SP_RPC_DEADLINE_EXCEEDED && wait_ms > 0)
      return sp_diag_set(d, SP_ETIMEDOUT,
                         "%s: not set within %" PRIu64 " ms", what, wait_ms);
    return rc;
  }
  Shardplane__V1__StoreGetResponse *r = (Shardplane__V1__StoreGetResponse *)m;
  if (!r->found) {
    rc = sp_diag_set(d, SP_ENOENT, "%s: no such key", what);
  } else {
    uint8_t *copy = malloc(r->value.len ? r->value.len : 1);
    if (copy == NULL) {
      rc = sp_diag_set(d, SP_ENOMEM, "out of memory");
    } else {
      if (r->value.len) memcpy(copy, r->value.data, r->value.len);
      *val = copy;
      *len = r->value.len;
    }
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return rc;
}

int sp_session_store_add(sp_session *s, const char *key, int64_t delta,
                         int64_t *value, sp_diag *d) {
  if (s == NULL) return sp_diag_set(d, SP_EINVAL, "store add: bad arguments");
  int rc = check_key("add", key, d);
  if (rc != 0) return rc;
  Shardplane__V1__StoreAddRequest q = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  q.key = (char *)key;
  q.delta = delta;
  char what[96];
  snprintf(what, sizeof what, "store add \"%.*s\"", KEY_SHOWN, key);
  ProtobufCMessage *m = NULL;
  rc = unary(s, what, METHOD("StoreAdd"), &q.base,
             &shardplane__v1__store_add_response__descriptor,
             s->call_timeout_ms, &m, NULL, d);
  if (rc != 0) return rc;
  if (value != NULL) *value = ((Shardplane__V1__StoreAddResponse *)m)->value;
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}

static int comm_store_set(void *user, const char *key, const void *val,
                          size_t len, sp_diag *d) {
  return sp_session_store_set(user, key, val, len, d);
}

static int comm_store_get(void *user, const char *key, uint64_t wait_ms,
                          uint8_t **val, size_t *len, sp_diag *d) {
  return sp_session_store_get(user, key, wait_ms, val, len, d);
}

static int comm_store_add(void *user, const char *key, int64_t delta,
                          int64_t *value, sp_diag *d) {
  return sp_session_store_add(user, key, delta, value, d);
}

sp_comm_store sp_session_comm_store(sp_session *s) {
  sp_comm_store cs = {comm_store_set, comm_store_get, comm_store_add, s};
  return cs;
}

/* ------------------------------------------------------------------ */
/* Reporting (training thread)                                         */
/* ------------------------------------------------------------------ */

/* Queues one event, or counts it dropped. No lock, no syscall except the
 * rare poke when the ring has filled to half. */
static inline void ring_push(sp_session *s, const sp_sess_event *e) {
  uint64_t h = s->head_local;
  if (h - s->tail_cache > s->mask) {
    s->tail_cache = atomic_load_explicit(&s->tail, memory_order_acquire);
    if (h - s->tail_cache > s->mask) {
      atomic_store_explicit(&s->dropped, ++s->dropped_local,
                            memory_order_relaxed);
      return;
    }
  }
  s->slots[h & s->mask] = *e;
  s->head_local = h + 1;
  atomic_store_explicit(&s->head, h + 1, memory_order_release);
  if (h + 1 >= s->half_check) {
    /* once per half ring of events: is the consumer behind? */
    s->tail_cache = atomic_load_explicit(&s->tail, memory_order_acquire);
    s->half_check = h + 1 + (s->mask + 1) / 2;
    if (h + 1 - s->tail_cache >= (s->mask + 1) / 2) uv_async_send(&s->wake);
  }
}

int sp_session_transition(sp_session *s, sp_machine m, uint32_t unit, int to,
                          sp_diag *d) {
  if (s == NULL) return sp_diag_set(d, SP_EINVAL, "session is NULL");
  bool root = m == SP_MACHINE_ROOT;
  if ((root || (m == SP_MACHINE_HANDLE && unit < s->st.n_units)) &&
      (unsigned)to < 8) {
    int from = root ? s->st.root : s->st.units[unit];
    if (s->legal[m][from][to]) {
      if (root)
        s->st.root = to;
      else
        s->st.units[unit] = (uint8_t)to;
      if (!s->no_report) {
        sp_sess_event e = {s->step_local, 0, root ? 0 : unit, EV_TRANSITION,
                           (uint8_t)m, (uint8_t)to};
        ring_push(s, &e);
      }
      return 0;
    }
  }
  /* illegal or invalid: the tracker names the legal next states */
  int rc = sp_state_tracker_apply(&s->st, m, root ? 0 : unit, to, d);
  if (rc == 0) rc = SP_ESTATE; /* the table said no: cannot happen */
  return sp_diag_prefix(d, rc, "rank %u", s->rank);
}

int sp_session_state(const sp_session *s, sp_machine m, uint32_t unit) {
  return s ? sp_state_tracker_get(&s->st, m, unit) : 0;
}

uint64_t sp_session_collective(sp_session *s, sp_coll_op op, uint32_t unit,
                               sp_dtype dtype, uint64_t count) {
  if (s == NULL) return 0;
  uint64_t seq = ++s->coll_seq;
  if (!s->no_report) {
    sp_sess_event e = {seq, count, unit, EV_COLLECTIVE, (uint8_t)op,
                       (uint8_t)dtype};
    ring_push(s, &e);
  }
  return seq;
}

int sp_session_set_report(sp_session *s, bool on, sp_diag *d) {
  if (s == NULL) return sp_diag_set(d, SP_EINVAL, "session is NULL");
  /* only where the coordinator's copy cannot fall behind: every state IDLE
   * on both sides, so the transitions skipped leave nothing to replay */
  bool idle = s->st.root == SP_ROOT_IDLE;
  for (size_t u = 0; idle && u < s->st.n_units; u++)
    idle = s->st.units[u] == SP_HANDLE_IDLE;
  if (!idle)
    return sp_diag_set(d, SP_ESTATE, "rank %u: reporting can be switched "
                       "only between steps (every state IDLE)", s->rank);
  s->no_report = !on;
  return 0;
}

void sp_session_set_step(sp_session *s, uint64_t step) {
  if (s == NULL) return;
  s->step_local = step;
  atomic_store_explicit(&s->step, step, memory_order_relaxed);
}

int sp_session_flush(sp_session *s, uint64_t timeout_ms, sp_diag *d) {
  if (s == NULL) return sp_diag_set(d, SP_EINVAL, "session is NULL");
  if (timeout_ms == 0) timeout_ms = 5000;
  uint64_t target = s->head_local;
  /* send now rather than at the next tick */
  if (s->thread_started) uv_async_send(&s->wake);
  uint64_t t0 = uv_hrtime();
  int rc = 0;
  uv_mutex_lock(&s->lock);
  while (s->first_error == 0 && !s->stream_done &&
         s->acked_events < target) {
    uint64_t spent = (uv_hrtime() - t0) / 1000000;
    if (spent >= timeout_ms) break;
    uv_cond_timedwait(&s->cond, &s->lock, (timeout_ms - spent) * 1000000);
  }
  if (s->first_error != 0)
    rc = sp_diag_set(d, s->first_error, "rank %u: %s", s->rank,
                     s->first_error_msg);
  else if (s->acked_events < target)
    rc = sp_diag_set(d, s->stream_done ? SP_EIO : SP_ETIMEDOUT,
                     "rank %u: %" PRIu64 " of %" PRIu64
                     " queued events unacknowledged after %" PRIu64 " ms",
                     s->rank, target - s->acked_events, target, timeout_ms);
  uv_mutex_unlock(&s->lock);
  return rc;
}

uint64_t sp_session_dropped(const sp_session *s) {
  return s ? atomic_load_explicit(&s->dropped, memory_order_relaxed) : 0;
}

bool sp_session_aborted(const sp_session *s, char *reason, size_t cap) {
  if (s == NULL) return false;
  if (!atomic_load(&s->aborted)) return false;
  if (reason != NULL && cap > 0) {
    sp_session *w = (sp_session *)s; /* the lock is not part of the value */
    uv_mutex_lock(&w->lock);
    snprintf(reason, cap, "%s", w->abort_reason);
    uv_mutex_unlock(&w->lock);
  }
  return true;
}
