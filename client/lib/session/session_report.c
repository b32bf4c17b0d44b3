/* Reporting (session.c has the overview): the training thread's side
 * (transitions and collectives into the lock-free ring, flush) and the
 * background thread's (its own loop keeping the Session stream: drain,
 * heartbeats, acknowledgements, rejections, ABORT). */
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "base/thread_name.h"
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
static bool outage_begin(sp_session *s);
static void outage_end(sp_session *s);

/* The background side's copy of the states, one event at a time. */
static inline void shadow_apply(sp_session *s, const sp_sess_event *e) {
  if (e->x == SP_MACHINE_ROOT)
    s->shadow_root = e->y;
  else if (e->unit < s->plan->n_units)
    s->shadow_units[e->unit] = e->y;
}

static void fifo_push(sp_session *s, uint64_t seq, uint64_t end, bool data) {
  inflight *f = &s->fifo[(s->fifo_first + s->fifo_n) % FIFO_CAP];
  *f = (inflight){seq, end, data};
  s->fifo_n++;
  if (data) s->data_inflight++;
}

/* Decodes one drained event: keeps the step and the issued fingerprints
 * (so a completion gets its own), and records it in the flight recorder.
 * Returns false for a step marker, which is no event of the wire. */
static bool bg_decode(sp_session *s, const sp_sess_event *e, sp_flight_ev *fe) {
  *fe = (sp_flight_ev){.time_us = e->time_us,
                       .kind = e->kind,
                       .comm = e->comm,
                       .step = s->bg_step};
  switch (e->kind) {
    case EV_STEP: s->bg_step = e->a; return false;
    case EV_TRANSITION:
      s->bg_step = e->a;
      fe->step = e->a;
      fe->unit = e->unit;
      fe->x = e->x;
      fe->y = e->y;
      break;
    case EV_COLLECTIVE: {
      fe->seq = e->a;
      fe->count = e->count;
      fe->unit = e->unit;
      fe->x = e->x;
      fe->y = e->y;
      if (e->comm < SP_SESSION_COMMS)
        s->issued[e->comm][e->a & s->issued_mask] =
            (sp_issued_fp){e->a, e->count, e->unit, e->x, e->y};
      break;
    }
    case EV_DONE: {
      fe->seq = e->a;
      fe->waited_us = e->count;
      if (e->comm < SP_SESSION_COMMS) {
        const sp_issued_fp *f = &s->issued[e->comm][e->a & s->issued_mask];
        /* an issue dropped by a full queue leaves only the seq */
        if (f->seq == e->a) {
          fe->count = f->count;
          fe->unit = f->unit;
          fe->x = f->op;
          fe->y = f->dtype;
        }
      }
      break;
    }
    default: return false;
  }
  s->flight[s->flight_n % s->flight_cap] = *fe;
  s->flight_n++;
  return true;
}

static void fill_transition(const sp_flight_ev *fe,
                            Shardplane__V1__Transition *t) {
  t->machine = (Shardplane__V1__Machine)fe->x;
  t->unit = fe->unit;
  t->state = fe->y;
  t->step = fe->step;
  t->time_us = fe->time_us;
}

static void fill_collective(const sp_session *s, const sp_flight_ev *fe,
                            Shardplane__V1__Collective *c) {
  c->seq = fe->seq;
  c->op = (Shardplane__V1__CollectiveOp)fe->x;
  c->unit = fe->unit;
  c->dtype = (Shardplane__V1__DType)fe->y;
  c->count = fe->count;
  c->comm = (Shardplane__V1__CommKind)fe->comm;
  c->comm_index = fe->comm < SP_SESSION_COMMS ? s->comm_index[fe->comm] : 0;
  c->completed = fe->kind == EV_DONE;
  c->time_us = fe->time_us;
  c->step = fe->step;
  if (fe->kind == EV_DONE) c->waited_us = fe->waited_us;
}

/* Sends one SessionUp with events [tail_local, tail_local + n), and the
 * flight record when one is given. */
static int send_up_flight(sp_session *s, size_t n,
                          Shardplane__V1__FlightRecord *flight) {
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.seq = s->next_seq;
  up.step = atomic_load_explicit(&s->step, memory_order_relaxed);
  up.time_us = sp_session_time_us();
  if (atomic_load_explicit(&s->has_loss, memory_order_acquire)) {
    uint64_t bits = atomic_load_explicit(&s->loss_bits, memory_order_relaxed);
    up.has_loss = true;
    memcpy(&up.loss, &bits, sizeof up.loss);
  }
  up.total_steps = atomic_load_explicit(&s->total_steps, memory_order_relaxed);
  up.tokens_per_step =
      atomic_load_explicit(&s->tokens_per_step, memory_order_relaxed);
  up.mem_bytes = atomic_load_explicit(&s->mem_bytes, memory_order_relaxed);
  up.mem_peak_bytes =
      atomic_load_explicit(&s->mem_peak_bytes, memory_order_relaxed);
  up.mem_predicted_bytes =
      atomic_load_explicit(&s->mem_predicted_bytes, memory_order_relaxed);
  up.flight = flight;
  up.sched_gap_ms = s->sched_gap_ms;
  if (s->need_bind) {
    /* the first message binds the stream to the rank */
    up.rank = s->rank;
    up.session_id = s->session_id;
    if (s->resyncing) {
      up.resync = true;
      up.root_state = s->shadow_root;
      up.n_unit_states = s->plan->n_units;
      up.unit_states = s->shadow_units;
      up.gap = s->gap;
    }
  }
  size_t nt = 0, nc = 0;
  for (size_t i = 0; i < n; i++) {
    const sp_sess_event *e = &s->slots[(s->tail_local + i) & s->mask];
    sp_flight_ev fe;
    if (!bg_decode(s, e, &fe)) continue;
    if (e->kind == EV_TRANSITION) {
      shadow_apply(s, e);
      fill_transition(&fe, &s->tr[nt]);
      s->trp[nt] = &s->tr[nt];
      nt++;
    } else {
      fill_collective(s, &fe, &s->co[nc]);
      s->cop[nc] = &s->co[nc];
      nc++;
    }
  }
  up.n_transitions = nt;
  up.transitions = s->trp;
  up.n_collectives = nc;
  up.collectives = s->cop;
  /* packs at once: the arrays are free again when this returns */
  int rc = sp_rpc_ccall_send_msg(s->call, &up.base);
  if (rc != 0) return rc;
  s->need_bind = false;
  s->sched_gap_ms = 0; /* told */
  s->next_seq++;
  uv_update_time(&s->loop); /* the first send runs before the loop does */
  s->last_send_ms = uv_now(&s->loop);
  fifo_push(s, up.seq, s->tail_local + n, n > 0);
  return 0;
}

static int send_up(sp_session *s, size_t n) {
  return send_up_flight(s, n, NULL);
}

/* Answers a pending FLIGHT_DUMP once the window has room: the recorder's
 * last dump_last_n events (0: all it keeps), oldest first. */
static void try_dump(sp_session *s) {
  if (!s->dump_pending || s->call == NULL || s->need_bind ||
      s->fifo_n >= FIFO_CAP)
    return;
  uint64_t have = s->flight_n < s->flight_cap ? s->flight_n : s->flight_cap;
  uint64_t n = s->dump_last_n && s->dump_last_n < have ? s->dump_last_n : have;
  Shardplane__V1__FlightRecord fr = SHARDPLANE__V1__FLIGHT_RECORD__INIT;
  fr.rank = s->rank;
  fr.request_id = s->dump_request;
  fr.recorded = s->flight_n;
  fr.capacity = s->flight_cap;
  fr.time_us = sp_session_time_us();
  /* n <= SP_SESSION_FLIGHT_MAX: bounded by the option's check */
  Shardplane__V1__Transition *tr = calloc(n ? n : 1, sizeof *tr);
  Shardplane__V1__Transition **trp = calloc(n ? n : 1, sizeof *trp);
  Shardplane__V1__Collective *co = calloc(n ? n : 1, sizeof *co);
  Shardplane__V1__Collective **cop = calloc(n ? n : 1, sizeof *cop);
  int rc = SP_ENOMEM;
  if (tr != NULL && trp != NULL && co != NULL && cop != NULL) {
    size_t nt = 0, nc = 0;
    for (uint64_t i = s->flight_n - n; i < s->flight_n; i++) {
      const sp_flight_ev *fe = &s->flight[i % s->flight_cap];
      if (fe->kind == EV_TRANSITION) {
        shardplane__v1__transition__init(&tr[nt]);
        fill_transition(fe, &tr[nt]);
        trp[nt] = &tr[nt];
        nt++;
      } else {
        shardplane__v1__collective__init(&co[nc]);
        fill_collective(s, fe, &co[nc]);
        cop[nc] = &co[nc];
        nc++;
      }
    }
    fr.n_transitions = nt;
    fr.transitions = trp;
    fr.n_collectives = nc;
    fr.collectives = cop;
    rc = send_up_flight(s, 0, &fr);
  }
  uint8_t *copy = NULL;
  size_t len = 0;
  if (rc == 0) {
    /* kept for the tests' look at what went out */
    len = shardplane__v1__flight_record__get_packed_size(&fr);
    copy = malloc(len ? len : 1);
    if (copy != NULL) shardplane__v1__flight_record__pack(&fr, copy);
  }
  free(tr);
  free(trp);
  free(co);
  free(cop);
  if (rc != 0) {
    char why[128];
    snprintf(why, sizeof why, "cannot send the flight record: %s",
             sp_strerror(rc));
    stream_fail(s, why);
    return;
  }
  s->dump_pending = false;
  uv_mutex_lock(&s->lock);
  s->dumps_sent++;
  free(s->last_flight);
  s->last_flight = copy;
  s->last_flight_len = len;
  uv_mutex_unlock(&s->lock);
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
     * drops for a stream that is gone (flush reports the stream's error).
     * While the coordinator is away they are a gap the reattach reports,
     * and the states they lead to are what it resends. */
    uint64_t h = atomic_load_explicit(&s->head, memory_order_acquire);
    for (uint64_t i = s->tail_local; i < h; i++) {
      const sp_sess_event *e = &s->slots[i & s->mask];
      sp_flight_ev fe;
      /* the recorder keeps them all the same: they happened */
      if (bg_decode(s, e, &fe) && s->resyncing && e->kind == EV_TRANSITION)
        shadow_apply(s, e);
    }
    if (s->resyncing) {
      s->gap += h - s->tail_local;
      s->gap_mark = h;
    }
    s->tail_local = h;
    atomic_store_explicit(&s->tail, s->tail_local, memory_order_release);
  }
  return sent;
}

/* A timer of this thread fired: how late against when it was due. A
 * process descheduled on a loaded host, stopped (SIGSTOP), paging or
 * stalled in I/O wakes up late by about as long, and its next message
 * says so (the coordinator weighs it before declaring the rank lost).
 * Returns now, for the timer's next due time. */
static uint64_t note_wakeup(sp_session *s, uint64_t due_ns) {
  uint64_t now = uv_hrtime();
  if (due_ns != 0 && now > due_ns) {
    uint64_t late_ms = (now - due_ns) / 1000000u;
    if (late_ms > s->sched_gap_ms) s->sched_gap_ms = late_ms;
  }
  return now;
}

static void on_drain_timer(uv_timer_t *t) {
  sp_session *s = t->data;
  note_wakeup(s, s->drain_due_ns);
  bool sent = drain(s);
  /* SP_SESSION_DRAIN_MS while events flow; back off when idle */
  if (sent)
    s->drain_delay = SP_SESSION_DRAIN_MS;
  else if (s->drain_delay < SP_SESSION_DRAIN_IDLE_MS)
    s->drain_delay *= 2;
  uv_update_time(&s->loop); /* from now, after the drain's own work */
  uv_timer_start(t, on_drain_timer, s->drain_delay, 0);
  s->drain_due_ns = uv_hrtime() + s->drain_delay * 1000000u;
}

static void on_hb_timer(uv_timer_t *t) {
  sp_session *s = t->data;
  /* a repeating timer: libuv armed the next one as this one ran */
  s->hb_due_ns = note_wakeup(s, s->hb_due_ns) + (uint64_t)s->hb_ms * 1000000u;
  if (s->call == NULL) return;
  try_dump(s);
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

/* The words of an ABORT: a victim says whose fault it is, so the operator
 * reading any rank's error finds the culprit. */
static void abort_reason(const sp_session *s,
                         const Shardplane__V1__SessionDown *m, char *out,
                         size_t cap) {
  const char *why =
      m->reason != NULL && m->reason[0] ? m->reason : "(no reason given)";
  if (!m->has_culprit) {
    snprintf(out, cap, "the coordinator sent ABORT: %s", why);
    return;
  }
  if (m->culprit == s->rank) {
    snprintf(out, cap, "aborted: this rank (%u) is at fault: %s", s->rank, why);
    return;
  }
  /* the coordinator's reason usually names the rank already */
  char name[32];
  snprintf(name, sizeof name, "rank %u", m->culprit);
  const char *p = strstr(why, name);
  bool named = p != NULL && (p[strlen(name)] < '0' || p[strlen(name)] > '9');
  if (named)
    snprintf(out, cap, "aborted: %s, not this rank's fault", why);
  else
    snprintf(out, cap, "aborted: rank %u failed: %s, not this rank's fault",
             m->culprit, why);
}

static void session_msg(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                        void *user) {
  (void)call;
  sp_session *s = user;
  if (s->resyncing) outage_end(s);
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
    abort_reason(s, m, reason, sizeof reason);
    if (m->has_culprit) {
      uv_mutex_lock(&s->lock);
      s->has_culprit = true;
      s->culprit = m->culprit;
      uv_mutex_unlock(&s->lock);
    }
    trigger_abort(s, reason);
  } else if (m->command == SHARDPLANE__V1__COMMAND__FLIGHT_DUMP) {
    /* a second request before the first was answered: the later one wins,
     * its asker is the one still waiting */
    s->dump_pending = true;
    s->dump_request = m->request_id;
    s->dump_last_n = m->last_n;
  } else if (m->command == SHARDPLANE__V1__COMMAND__QUORUM) {
    /* announcements may pass each other on a reconnect: the newest wins */
    uint64_t was = atomic_load(&s->quorum_epoch);
    while (
        m->quorum_epoch > was &&
        !atomic_compare_exchange_weak(&s->quorum_epoch, &was, m->quorum_epoch))
      ;
    if (m->quorum_epoch > was) {
      /* under the lock: the hook's owner unsets it before it goes */
      uv_mutex_lock(&s->lock);
      if (s->on_quorum != NULL) s->on_quorum(s->quorum_user, m->quorum_epoch);
      uv_mutex_unlock(&s->lock);
    }
  }
  shardplane__v1__session_down__free_unpacked(m, NULL);
  /* acknowledgements open the window; the recorder then holds what was
   * queued up to now, which the dump sends */
  if (s->call != NULL) drain(s);
  try_dump(s);
}

static void session_close(sp_rpc_ccall *call, const sp_rpc_status *st,
                          void *user) {
  (void)call;
  sp_session *s = user;
  s->call = NULL;
  bool closing = atomic_load(&s->closing);
  /* the coordinator went away (killed, restarting): ride it out */
  if (!closing && st->code == SP_RPC_UNAVAILABLE && outage_begin(s)) return;
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

/* ---- coordinator outages ----
 * A bound stream that ends UNAVAILABLE (the coordinator died or is
 * restarting) is not the job's end: training goes on over the
 * communicators, which need no coordinator after rendezvous. The stream
 * is started again with jittered exponential backoff; its first message
 * names the session, resends the states (as of the events that follow)
 * and the gap (events drained while away, or sent and never
 * acknowledged). The grace timer, armed once per outage, gives up. */

static void on_retry(uv_timer_t *t) {
  sp_session *s = t->data;
  if (s->gave_up || atomic_load(&s->stop) || s->call != NULL) return;
  s->need_bind = true;
  int rc = sp_rpc_client_start(s->cl, SP_COORD_PATH("Session"), NULL, 0, 0,
                               &k_session_cbs, s, &s->call);
  /* a failed start closes the call (UNAVAILABLE): session_close then
   * schedules the next attempt */
  if (rc == 0 && s->call != NULL) rc = send_up(s, 0);
  if (rc != 0 && s->call != NULL) {
    /* a fresh stream that cannot take its first message: a real error,
     * which the close (CANCELLED) makes final */
    stream_fail(s, "cannot resend the session's state on a new stream");
  } else if (rc != 0) {
    uv_update_time(&s->loop);
    uv_timer_start(&s->retry_timer, on_retry,
                   sp_session_backoff(&s->backoff_ms, &s->jitter), 0);
  }
}

static void on_grace(uv_timer_t *t) {
  sp_session *s = t->data;
  if (!s->resyncing || s->gave_up) return;
  s->gave_up = true;
  uv_timer_stop(&s->retry_timer);
  char msg[ERRMSG_MAX - 32];
  snprintf(msg, sizeof msg,
           "the coordinator at %s was unreachable for longer than the grace "
           "period of %" PRIu64 " ms (--coordinator-grace)",
           s->coordinator, s->grace_ms);
  uv_mutex_lock(&s->lock);
  set_first_error_locked(s, SP_ETIMEDOUT, msg);
  s->stream_done = true;
  s->away = false;
  uv_cond_broadcast(&s->cond);
  uv_mutex_unlock(&s->lock);
  /* the reason first: cancelling closes the call, which would give its own */
  trigger_abort(s, msg);
  if (s->call != NULL) sp_rpc_ccall_cancel(s->call);
}

/* Returns false when the outage is not ridden out (no grace, after giving
 * up, winding down): the stream's end is then final. Also before the first
 * binding was acknowledged: Attach has given the session id, so a
 * coordinator that dies now comes back knowing it (open waits). */
static bool outage_begin(sp_session *s) {
  if (s->gave_up || s->grace_ms == 0 || atomic_load(&s->stop)) return false;
  uv_mutex_lock(&s->lock);
  uint64_t acked = s->acked_events;
  if (!s->away) {
    s->away = true;
    s->away_since_ns = uv_hrtime();
  }
  uv_mutex_unlock(&s->lock);
  /* sent and never acknowledged: the coordinator may not have them */
  uint64_t from = acked > s->gap_mark ? acked : s->gap_mark;
  if (s->tail_local > from) s->gap += s->tail_local - from;
  s->gap_mark = s->tail_local;
  if (!s->resyncing) {
    s->resyncing = true;
    s->backoff_ms = 0;
    uv_update_time(&s->loop);
    uv_timer_start(&s->grace_timer, on_grace, s->grace_ms, 0);
  }
  s->fifo_n = 0;
  s->fifo_first = 0;
  s->data_inflight = 0;
  uv_update_time(&s->loop);
  uv_timer_start(&s->retry_timer, on_retry,
                 sp_session_backoff(&s->backoff_ms, &s->jitter), 0);
  return true;
}

/* The coordinator answered the new stream: the session is whole again. */
static void outage_end(sp_session *s) {
  s->resyncing = false;
  s->backoff_ms = 0;
  uv_timer_stop(&s->grace_timer);
  uv_mutex_lock(&s->lock);
  s->away = false;
  s->reattaches++;
  s->gap_total += s->gap;
  uv_cond_broadcast(&s->cond);
  uv_mutex_unlock(&s->lock);
  s->gap = 0;
}

static void on_wake(uv_async_t *a) {
  sp_session *s = a->data;
  if (!atomic_load(&s->stop)) {
    uv_mutex_lock(&s->lock);
    uint8_t *down = s->test_down;
    size_t down_len = s->test_down_len;
    s->test_down = NULL;
    uv_mutex_unlock(&s->lock);
    if (down != NULL) {
      if (s->call != NULL) session_msg(s->call, down, down_len, s);
      free(down);
    }
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
  uv_timer_stop(&s->retry_timer);
  uv_timer_stop(&s->grace_timer);
  uv_close((uv_handle_t *)&s->drain_timer, NULL);
  uv_close((uv_handle_t *)&s->hb_timer, NULL);
  uv_close((uv_handle_t *)&s->retry_timer, NULL);
  uv_close((uv_handle_t *)&s->grace_timer, NULL);
  uv_close((uv_handle_t *)&s->wake, NULL);
}

static void bg_main(void *arg) {
  sp_session *s = arg;
  sp_thread_name("session");
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
  /* open starts this before the first transition: every state IDLE */
  s->shadow_units = calloc(s->plan->n_units + 1, sizeof *s->shadow_units);
  if (s->shadow_units == NULL)
    return sp_diag_set(d, SP_ENOMEM, "out of memory");
  /* collectives in flight per communicator are at most the runtime's
   * queue (2 * units + 16): a table twice that never overwrites an issue
   * before its completion is drained */
  uint64_t need = 4 * (uint64_t)s->plan->n_units + 64, cap = 64;
  while (cap < need) cap <<= 1;
  s->issued_mask = cap - 1;
  for (int k = 0; k < SP_SESSION_COMMS; k++) {
    s->issued[k] = calloc((size_t)cap, sizeof *s->issued[k]);
    if (s->issued[k] == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  }
  s->flight = calloc(s->flight_cap, sizeof *s->flight);
  if (s->flight == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  s->shadow_root = SP_ROOT_IDLE;
  for (size_t u = 0; u < s->plan->n_units; u++)
    s->shadow_units[u] = SP_HANDLE_IDLE;
  s->jitter = uv_hrtime() ^ ((uint64_t)s->rank << 32);
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
  uv_timer_init(&s->loop, &s->retry_timer);
  uv_timer_init(&s->loop, &s->grace_timer);
  s->wake.data = s->drain_timer.data = s->hb_timer.data = s;
  s->retry_timer.data = s->grace_timer.data = s;
  s->next_seq = 1;
  s->need_bind = true;
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
  s->drain_due_ns = uv_hrtime() + s->drain_delay * 1000000u;
  s->hb_due_ns = uv_hrtime() + (uint64_t)s->hb_ms * 1000000u;
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
        sp_sess_event e = {
            s->step_local, 0,          sp_session_time_us(), root ? 0 : unit,
            EV_TRANSITION, (uint8_t)m, (uint8_t)to,          0};
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

uint64_t sp_session_time_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

uint64_t sp_session_collective(sp_session *s, sp_comm_kind comm, sp_coll_op op,
                               uint32_t unit, sp_dtype dtype, uint64_t count) {
  if (s == NULL || (unsigned)comm >= SP_SESSION_COMMS) return 0;
  uint64_t seq = ++s->coll_seq[comm];
  if (!s->no_report) {
    sp_sess_event e = {
        seq,           count,       sp_session_time_us(), unit,
        EV_COLLECTIVE, (uint8_t)op, (uint8_t)dtype,       (uint8_t)comm};
    ring_push(s, &e);
  }
  return seq;
}

void sp_session_collective_done(sp_session *s, sp_comm_kind comm, uint64_t seq,
                                uint64_t time_us, uint64_t waited_us) {
  if (s == NULL || s->no_report || (unsigned)comm >= SP_SESSION_COMMS ||
      seq == 0)
    return;
  /* a completion has no count of its own: the wait rides there */
  sp_sess_event e = {
      seq, waited_us,    time_us ? time_us : sp_session_time_us(),
      0,   EV_DONE,      0,
      0,   (uint8_t)comm};
  ring_push(s, &e);
}

void sp_session_set_progress(sp_session *s, double loss, uint64_t total_steps) {
  if (s == NULL) return;
  uint64_t bits;
  memcpy(&bits, &loss, sizeof bits);
  atomic_store_explicit(&s->loss_bits, bits, memory_order_relaxed);
  atomic_store_explicit(&s->total_steps, total_steps, memory_order_relaxed);
  atomic_store_explicit(&s->has_loss, !isnan(loss), memory_order_release);
}

void sp_session_set_throughput(sp_session *s, uint64_t tokens_per_step) {
  if (s == NULL) return;
  atomic_store_explicit(&s->tokens_per_step, tokens_per_step,
                        memory_order_relaxed);
}

void sp_session_set_memory(sp_session *s, uint64_t in_use, uint64_t peak,
                           uint64_t predicted) {
  if (s == NULL) return;
  /* each figure on its own: a message may carry one new and one old, and
   * the next carries both new */
  atomic_store_explicit(&s->mem_bytes, in_use, memory_order_relaxed);
  atomic_store_explicit(&s->mem_peak_bytes, peak, memory_order_relaxed);
  atomic_store_explicit(&s->mem_predicted_bytes, predicted,
                        memory_order_relaxed);
}

int sp_session_set_report(sp_session *s, bool on, sp_diag *d) {
  if (s == NULL) return sp_diag_set(d, SP_EINVAL, "session is NULL");
  /* only where the coordinator's copy cannot fall behind: every state IDLE
   * on both sides, so the transitions skipped leave nothing to replay */
  bool idle = s->st.root == SP_ROOT_IDLE;
  for (size_t u = 0; idle && u < s->st.n_units; u++)
    idle = s->st.units[u] == SP_HANDLE_IDLE;
  if (!idle)
    return sp_diag_set(d, SP_ESTATE,
                       "rank %u: reporting can be switched "
                       "only between steps (every state IDLE)",
                       s->rank);
  s->no_report = !on;
  return 0;
}

void sp_session_set_step(sp_session *s, uint64_t step) {
  if (s == NULL) return;
  s->step_local = step;
  atomic_store_explicit(&s->step, step, memory_order_relaxed);
  if (!s->no_report) {
    sp_sess_event e = {step, 0, sp_session_time_us(), 0, EV_STEP, 0, 0, 0};
    ring_push(s, &e);
  }
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
  while (s->first_error == 0 && !s->stream_done && s->acked_events < target) {
    uint64_t spent = (uv_hrtime() - t0) / 1000000;
    /* a coordinator outage may last its grace period, which ends it
     * (reattached, or given up) */
    if (spent >= timeout_ms && !s->away) break;
    uint64_t left = spent < timeout_ms ? timeout_ms - spent : 100;
    uv_cond_timedwait(&s->cond, &s->lock, left * 1000000);
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

bool sp_session_culprit(const sp_session *s, uint32_t *rank) {
  if (s == NULL || !atomic_load(&s->aborted)) return false;
  sp_session *w = (sp_session *)s; /* the lock is not part of the value */
  uv_mutex_lock(&w->lock);
  bool has = w->has_culprit;
  if (has && rank != NULL) *rank = w->culprit;
  uv_mutex_unlock(&w->lock);
  return has;
}

int sp_session_test_down(sp_session *s, const Shardplane__V1__SessionDown *m) {
  size_t len = shardplane__v1__session_down__get_packed_size(m);
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL) return SP_ENOMEM;
  shardplane__v1__session_down__pack(m, buf);
  uv_mutex_lock(&s->lock);
  free(s->test_down);
  s->test_down = buf;
  s->test_down_len = len;
  uv_mutex_unlock(&s->lock);
  uv_async_send(&s->wake);
  return 0;
}

Shardplane__V1__FlightRecord *sp_session_test_last_flight(sp_session *s) {
  uv_mutex_lock(&s->lock);
  Shardplane__V1__FlightRecord *fr =
      s->last_flight == NULL ? NULL
                             : shardplane__v1__flight_record__unpack(
                                   NULL, s->last_flight_len, s->last_flight);
  uv_mutex_unlock(&s->lock);
  return fr;
}

uint64_t sp_session_coll_seq(const sp_session *s, sp_comm_kind k) {
  return s != NULL && (unsigned)k < SP_SESSION_COMMS ? s->coll_seq[k] : 0;
}

void sp_session_set_quorum_hook(sp_session *s,
                                void (*fn)(void *user, uint64_t epoch),
                                void *user) {
  if (s == NULL) return;
  uv_mutex_lock(&s->lock);
  s->on_quorum = fn;
  s->quorum_user = user;
  uv_mutex_unlock(&s->lock);
}

uint64_t sp_session_quorum_epoch(const sp_session *s) {
  return s == NULL ? 0 : atomic_load(&((sp_session *)s)->quorum_epoch);
}

uint64_t sp_session_flight_dumps(const sp_session *s) {
  if (s == NULL) return 0;
  sp_session *w = (sp_session *)s;
  uv_mutex_lock(&w->lock);
  uint64_t n = w->dumps_sent;
  uv_mutex_unlock(&w->lock);
  return n;
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
