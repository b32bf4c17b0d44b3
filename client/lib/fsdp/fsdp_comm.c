/* The communication thread of the FSDP runtime: it runs the queued
 * collectives in issue order on the comm lane (fsdp_internal.h), which is
 * what lets an all-gather issued as a prefetch overlap the caller's
 * compute. Every rank queues the same work in the same order (the schedule,
 * fsdp_schedule.c), as the backends require. */
#include <stdlib.h>

#include "base/clock.h"
#include "base/thread_name.h"
#include "fsdp_internal.h"

static sp_comm *gather_comm(sp_fsdp *f) {
  return f->plan->strategy == SP_HYBRID_SHARD ? f->shard_comm : f->world_comm;
}

/* ---- collectives on the comm lane ----
 * On the CPU these are the sp_comm calls themselves. On a GPU the
 * communicator runs on a stream of its own (sp_comm_cuda_stream) and
 * returns when its operation has completed on the device; the comm lane's
 * casts issued before must precede it, so an event on the comm lane is
 * handed to that stream first. Later comm-lane work follows the return,
 * hence the completed operation. */

static int handoff(sp_fsdp *f, sp_comm *c, sp_diag *d) {
  if (!f->dev) return 0; /* host storage, staged or not: nothing queued */
  void *stream = NULL;
  int rc = sp_comm_cuda_stream(c, &stream);
  if (rc < 0)
    return sp_diag_set(d, rc,
                       "the communicator has no CUDA stream (not an "
                       "NCCL communicator?)");
  return f->mem->handoff(f, stream, d);
}

/* Each stamps the time the collective returned into w's next report
 * (the work's fingerprints are in the order its collectives run). */
static void stamp(sp_fsdp_work *w, size_t *next) {
  if (*next < w->n_fp) w->fp[*next].done_us = sp_session_time_us();
  (*next)++;
}

static int coll_all_gather(sp_fsdp *f, sp_fsdp_work *w, size_t *next,
                           sp_comm *c, const void *send, void *recv,
                           size_t count, sp_dtype dt, sp_diag *d) {
  int rc = handoff(f, c, d);
  if (rc == 0) rc = sp_comm_all_gather(c, send, recv, count, dt, d);
  if (rc == 0) stamp(w, next);
  return rc;
}

static int coll_reduce_scatter(sp_fsdp *f, sp_fsdp_work *w, size_t *next,
                               sp_comm *c, const void *send, void *recv,
                               size_t count, sp_dtype dt, sp_diag *d) {
  int rc = handoff(f, c, d);
  if (rc == 0) rc = sp_comm_reduce_scatter(c, send, recv, count, dt, d);
  if (rc == 0) stamp(w, next);
  return rc;
}

static int coll_all_reduce(sp_fsdp *f, sp_fsdp_work *w, size_t *next,
                           sp_comm *c, void *buf, size_t count, sp_dtype dt,
                           sp_diag *d) {
  int rc = handoff(f, c, d);
  if (rc == 0) rc = sp_comm_all_reduce(c, buf, count, dt, d);
  if (rc == 0) stamp(w, next);
  return rc;
}

sp_comm_kind sp_fsdp_gather_kind(const sp_fsdp *f) {
  return f->plan->strategy == SP_HYBRID_SHARD ? SP_COMM_SHARD : SP_COMM_WORLD;
}

void sp_fsdp_fp_issue(sp_fsdp *f, sp_fsdp_work *w, sp_comm_kind k,
                      sp_coll_op op, uint32_t unit, sp_dtype dt,
                      uint64_t count) {
  uint64_t seq = sp_session_collective(f->s, k, op, unit, dt, count);
  if (w->n_fp < 2) w->fp[w->n_fp++] = (sp_fsdp_fp){seq, 0, (uint8_t)k};
}

int sp_fsdp_before_collective(sp_fsdp *f, sp_comm_kind k, sp_coll_op op,
                              uint32_t unit, uint64_t *count, sp_diag *d) {
  if (f->opts.before_collective == NULL) return 0;
  int rc = f->opts.before_collective(f->opts.inject_user, f->phase, k, op, unit,
                                     count);
  if (rc < 0)
    return sp_diag_set(d, rc,
                       "unit %u (%s): the before_collective hook "
                       "failed: %s",
                       unit, sp_fsdp_unit_name(f, unit), sp_strerror(rc));
  if (rc == 1 && op != SP_OP_ALL_GATHER)
    return sp_diag_set(d, SP_EINVAL,
                       "unit %u: before_collective may skip "
                       "only an all-gather",
                       unit);
  return rc;
}

/* Reports the completion of every ticket finished since the last call, in
 * issue order. Under f->mu, on the training thread (the session's queue
 * has one producer). */
static void report_done_locked(sp_fsdp *f) {
  f->stats.comm_busy_s = (double)f->comm_busy_ns * 1e-9;
  for (; f->reported < f->completed; f->reported++) {
    const sp_fsdp_work *w =
        &f->queue[(size_t)(f->reported % (int64_t)f->queue_cap)];
    for (size_t i = 0; i < w->n_fp; i++)
      if (w->fp[i].done_us != 0) {
        /* the training thread's wait just ended: it goes with the first
         * completion seen after it (the one it waited for, or the last
         * before it) */
        sp_session_collective_done(f->s, (sp_comm_kind)w->fp[i].comm,
                                   w->fp[i].seq, w->fp[i].done_us,
                                   f->waited_us);
        f->waited_us = 0;
      }
  }
}

/* Blocks on f->cv (f->mu held), counting the time into f->waited_us: the
 * training thread waiting for the communication thread, that is for its
 * peers. */
static void wait_locked(sp_fsdp *f) {
  uint64_t t0 = sp_session_time_us();
  pthread_cond_wait(&f->cv, &f->mu);
  f->waited_us += sp_session_time_us() - t0;
}

/* ---- the communication thread ---- */

/* The unshard: the shard goes into this rank's own place of the unsharded
 * buffer (cast to param_dtype when that differs, and always on a GPU, whose
 * cast kernel also copies), then the all-gather runs in place (send = recv
 * + rank * c); a flat unit stops after the cast (one whose full is its
 * shard is never gathered). A host shard already in param_dtype is sent
 * from where it is, which Gloo moves into place itself. Casting into the
 * slot rather than into a separate low-precision shard saves
 * c * param_dtype bytes per unit and gives the same bits. */
static int run_gather(sp_fsdp *f, sp_fsdp_work *w, sp_fsdp_unit *fu,
                      sp_diag *d) {
  const sp_unit *u = fu->u;
  bool no_shard = f->flat;
  sp_comm *c = gather_comm(f);
  size_t slot = no_shard ? 0 : (size_t)sp_comm_rank(c) * (size_t)fu->c;
  uint8_t *mine = fu->full + slot * fu->psize;
  const void *send = fu->shard;
  if (f->dev || u->param_dtype != u->dtype) {
    int rc = f->mem->cast(f, SP_LANE_COMM, mine, u->param_dtype, fu->shard,
                          u->dtype, (size_t)fu->c, d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "casting the shard to %s",
                            sp_dtype_name(u->param_dtype));
    send = mine;
  }
  if (no_shard)
    return send == mine ? 0
                        : f->mem->copy(f, SP_LANE_COMM, mine, send,
                                       (size_t)fu->c * fu->psize, d);
  size_t next = 0;
  return coll_all_gather(f, w, &next, c, send, fu->full, (size_t)fu->c,
                         u->param_dtype, d);
}

/* The sum over the replica group, when there is one of more than this
 * rank. Under a quorum (fsdp_quorum.c) a failure is the step's, not the
 * runtime's: it is remembered, the replica sums left in the step are
 * skipped, and the step is discarded at its commit. */
static int replica_sum(sp_fsdp *f, sp_fsdp_work *w, size_t *next, void *buf,
                       size_t count, sp_dtype dt, sp_diag *d) {
  if (!f->replica_comm || sp_comm_size(f->replica_comm) < 2) return 0;
  if (!f->q_on)
    return coll_all_reduce(f, w, next, f->replica_comm, buf, count, dt, d);
  /* skipped or failed, it is reported done: the step's fate is the
   * commit's, and a collective that never completes is a hang to the
   * coordinator */
  if (f->q_broken) {
    stamp(w, next);
    return 0;
  }
  sp_diag rd = {{0}};
  if (coll_all_reduce(f, w, next, f->replica_comm, buf, count, dt, &rd) < 0) {
    sp_fsdp_quorum_failed(f, &rd);
    stamp(w, next);
  }
  return 0;
}

/* A flat unit's reduction, FSDP's _reduce_grad_no_shard: the all-reduce
 * over the world runs in place (over one rank there is nothing to sum,
 * only the report), and the sum is divided and cast from where it is, so
 * no second buffer of the unit's size (158 MB for GPT-2's root) is
 * needed. in is the unsharded gradient, or red_in. */
static int reduce_flat(sp_fsdp *f, sp_fsdp_work *w, sp_fsdp_unit *fu,
                       uint8_t *in, sp_diag *d) {
  size_t next = 0, n = (size_t)fu->c;
  sp_dtype rdt = fu->u->reduce_dtype;
  int rc = 0;
  if (f->q_on) /* groups of one under a replica quorum */
    rc = replica_sum(f, w, &next, in, w->count ? w->count : n, rdt, d);
  else if (f->world > 1)
    rc = coll_all_reduce(f, w, &next, f->world_comm, in,
                         w->count ? w->count : n, rdt, d);
  else
    stamp(w, &next);
  if (rc < 0) return rc;
  /* post-divide, cast to the shard's gradient dtype and add to it: the
   * sharded gradient accumulates until the optimizer step or zero_grad */
  if (!fu->grad_is_shard)
    return f->mem->acc_div(f, SP_LANE_COMM, fu->shard_grad, fu->grad_dtype, in,
                           rdt, n, f->post_divide, d);
  /* the shard gradient was the buffer reduced: it held the step's earlier
   * reductions when the trainer added this gradient to it, so the
   * reduced sum replaces it (as NO_SHARD's .grad in FSDP) */
  rc = f->mem->scale_div(f, SP_LANE_COMM, in, rdt, n, f->post_divide, d);
  if (rc == 0 && in != fu->shard_grad)
    rc = f->mem->cast(f, SP_LANE_COMM, fu->shard_grad, fu->grad_dtype, in, rdt,
                      n, d);
  return rc;
}

/* The post-backward reduction: FSDP's _post_backward_hook +
 * _reduce_grad / _reduce_grad_no_shard. */
static int run_reduce(sp_fsdp *f, sp_fsdp_work *w, sp_fsdp_unit *fu,
                      sp_diag *d) {
  const sp_unit *u = fu->u;
  size_t next = 0;
  /* an injected wrong count (only ever lower: within both buffers) */
  size_t rc_count = w->count ? w->count : (size_t)fu->c;
  const sp_fsdp_mem_ops *mem = f->mem;
  sp_dtype rdt = u->reduce_dtype;
  size_t padded = (size_t)fu->padded;
  uint8_t *in = fu->full_grad;
  int rc;
  if (fu->red_in) {
    rc = mem->cast(f, SP_LANE_COMM, fu->red_in, rdt, fu->full_grad,
                   u->param_dtype, padded, d);
    if (rc < 0) return rc;
    in = fu->red_in;
  }
  rc = mem->scale_div(f, SP_LANE_COMM, in, rdt, padded, f->pre_divide, d);
  if (rc < 0) return rc;
  if (f->flat) return reduce_flat(f, w, fu, in, d);
  uint8_t *out = fu->red_out;
  switch (f->plan->strategy) {
    case SP_HYBRID_SHARD:
      rc = coll_reduce_scatter(f, w, &next, f->shard_comm, in, fu->red_out,
                               rc_count, rdt, d);
      if (rc == 0)
        rc = replica_sum(f, w, &next, fu->red_out, (size_t)fu->c, rdt, d);
      if (rc < 0) return rc;
      break;
    default:
      rc = coll_reduce_scatter(f, w, &next, f->world_comm, in, fu->red_out,
                               rc_count, rdt, d);
      if (rc < 0) return rc;
  }
  /* post-divide, cast to the shard's gradient dtype and add to it: the
   * sharded gradient accumulates until the optimizer step or zero_grad */
  return mem->acc_div(f, SP_LANE_COMM, fu->shard_grad, fu->grad_dtype, out, rdt,
                      (size_t)fu->c, f->post_divide, d);
}

static int run_work(sp_fsdp *f, sp_fsdp_work *w, sp_diag *d) {
  bool caller_buf =
      w->kind == SP_WORK_ALL_REDUCE || w->kind == SP_WORK_SHARD_ALL_REDUCE;
  sp_fsdp_unit *fu = caller_buf ? NULL : &f->units[w->unit];
  size_t next = 0;
  int rc;
  switch (w->kind) {
    case SP_WORK_GATHER: rc = run_gather(f, w, fu, d); break;
    case SP_WORK_REDUCE: rc = run_reduce(f, w, fu, d); break;
    case SP_WORK_ALL_REDUCE:
      if (!f->q_on) {
        rc = coll_all_reduce(f, w, &next, f->world_comm, w->buf, w->count,
                             w->dt, d);
        break;
      }
      /* no communicator spans the world: the shard group's sum, then
       * the replica group's */
      rc = coll_all_reduce(f, w, &next, f->shard_comm, w->buf, w->count, w->dt,
                           d);
      if (rc == 0) rc = replica_sum(f, w, &next, w->buf, w->count, w->dt, d);
      break;
    case SP_WORK_SHARD_ALL_REDUCE:
      rc = coll_all_reduce(f, w, &next, gather_comm(f), w->buf, w->count, w->dt,
                           d);
      break;
    case SP_WORK_GATHER_MASTER: {
      /* never queued for a flat unit, which copies its master itself */
      const void *src = w->src ? w->src : fu->shard;
      sp_dtype dt = w->src ? w->dt : fu->u->dtype;
      rc = coll_all_gather(f, w, &next, gather_comm(f), src, w->buf,
                           (size_t)fu->c, dt, d);
      break;
    }
    default:
      rc = sp_diag_set(d, SP_EINVAL, "unknown work kind %d", (int)w->kind);
  }
  /* complete means finished on the device: the waiter may use the result
   * on any stream, and the next item may reuse this one's scratch */
  if (rc == 0) rc = f->mem->drain(f, SP_LANE_COMM, d);
  if (rc < 0 && !caller_buf)
    sp_diag_prefix(d, rc, "unit %u (%s)", w->unit,
                   sp_fsdp_unit_name(f, w->unit));
  return rc;
}

/* Runs the oldest queued item: f->mu held on entry and on return, dropped
 * while the work runs. */
static void run_next_locked(sp_fsdp *f) {
  size_t slot = (size_t)(f->completed % (int64_t)f->queue_cap);
  sp_fsdp_work w = f->queue[slot];
  int failed = f->error;
  pthread_mutex_unlock(&f->mu);
  sp_diag d = {{0}};
  /* after a failure the rest of the queue is not run: the collective
   * sequence is broken and peers would hang on a half-issued op */
  int rc = failed;
  if (!failed) rc = f->mem->wait_mark(f, slot, &d);
  double t0 = sp_clock_s();
  if (rc == 0) rc = run_work(f, &w, &d);
  double busy = sp_clock_s() - t0;
  pthread_mutex_lock(&f->mu);
  f->comm_busy_ns += (uint64_t)(busy * 1e9);
  if (rc < 0 && !f->error) {
    f->error = rc;
    f->error_diag = d;
  }
  /* the times the collectives returned, for report_done_locked */
  for (size_t i = 0; i < w.n_fp; i++)
    f->queue[slot].fp[i].done_us = rc == 0 ? w.fp[i].done_us : 0;
  f->completed++;
  pthread_cond_broadcast(&f->cv);
}

static void *comm_thread(void *arg) {
  sp_fsdp *f = arg;
  sp_thread_name("comm");
  sp_diag init_d = {{0}};
  int init_rc = f->mem->thread_init ? f->mem->thread_init(f, &init_d) : 0;
  pthread_mutex_lock(&f->mu);
  if (init_rc < 0 && !f->error) {
    f->error = init_rc;
    f->error_diag = init_d;
  }
  for (;;) {
    while (!f->stopping && f->completed == f->issued)
      pthread_cond_wait(&f->cv, &f->mu);
    if (f->completed == f->issued) break; /* stopping and drained */
    run_next_locked(f);
  }
  pthread_mutex_unlock(&f->mu);
  return NULL;
}

int64_t sp_fsdp_enqueue(sp_fsdp *f, const sp_fsdp_work *w, sp_diag *d) {
  pthread_mutex_lock(&f->mu);
  /* a full ring waits for the oldest: bounded by construction (at most one
   * gather and one reduce per unit plus caller all-reduces are pending) */
  while (f->issued - f->completed >= (int64_t)f->queue_cap && !f->error)
    wait_locked(f);
  /* before a slot is written again */
  report_done_locked(f);
  if (f->error) {
    int rc = f->error;
    if (d) *d = f->error_diag;
    pthread_mutex_unlock(&f->mu);
    return rc;
  }
  int64_t t = f->issued;
  size_t slot = (size_t)(t % (int64_t)f->queue_cap);
  /* the slot's previous item has completed (the ring is not full), so its
   * mark may be recorded again */
  sp_diag md = {{0}};
  int mrc = f->mem->mark(f, slot, &md);
  if (mrc < 0) {
    pthread_mutex_unlock(&f->mu);
    if (d) *d = md;
    return mrc;
  }
  f->issued++;
  f->queue[slot] = *w;
  if (f->inline_comm)
    run_next_locked(f);
  else
    pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  return t;
}

int sp_fsdp_wait(sp_fsdp *f, int64_t ticket, sp_diag *d) {
  pthread_mutex_lock(&f->mu);
  while (f->completed <= ticket && !f->error) wait_locked(f);
  report_done_locked(f);
  int rc = f->error;
  if (rc && d) *d = f->error_diag;
  pthread_mutex_unlock(&f->mu);
  return rc;
}

bool sp_fsdp_ticket_done(sp_fsdp *f, int64_t ticket) {
  pthread_mutex_lock(&f->mu);
  bool done = f->completed > ticket;
  report_done_locked(f);
  pthread_mutex_unlock(&f->mu);
  return done;
}

int sp_fsdp_comm_start(sp_fsdp *f, sp_diag *d) {
  /* A world of one on host storage has nothing to overlap (its
   * collectives are copies at most), and every hand-off to the thread and
   * back cost two wake-ups: 0.015 s of a 1.25 s gpt2-mini step on an idle
   * machine, far more on a loaded one, where a woken thread waits for a
   * core. Its work runs in sp_fsdp_enqueue instead, in the same order. */
  if (f->world == 1 && !f->dev) {
    f->inline_comm = true;
    return 0;
  }
  if (pthread_create(&f->thread, NULL, comm_thread, f) != 0)
    return sp_diag_set(d, SP_ENOMEM, "cannot start the communication thread");
  f->thread_started = true;
  return 0;
}

void sp_fsdp_comm_stop(sp_fsdp *f) {
  if (!f->thread_started) return;
  pthread_mutex_lock(&f->mu);
  f->stopping = true;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  pthread_join(f->thread, NULL);
}
