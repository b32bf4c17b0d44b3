/* Reporting (session.c has the overview): the training thread's side
 * (transitions and collectives into the lock-free ring, flush) and the
 * background thread's (its own loop keeping the Session stream: drain,
 * heartbeats, acknowledgements, rejections, ABORT). */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "session_internal.h"

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
int sp_session_bg_start(sp_session *s, sp_diag *d) {
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
  sp_session_cred_client_opts(&s->cred, &co);
  int rc = sp_rpc_client_open(&s->loop, s->coordinator, &co, &s->cl);
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
  rc = sp_rpc_client_start(s->cl, SP_COORD_PATH("Session"), NULL, 0, 0,
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

void sp_session_bg_stop(sp_session *s) {
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

