/* The FSDP schedule: the hooks a trainer calls around each unit's forward
 * and backward (FSDP's pre/post-forward and pre/post-backward hooks, the
 * final callback), unshard with the in-flight limiter, prefetch, the
 * optimizer step and the caller's collectives. Each moves the unit's state
 * machine through the session before or after it acts, and queues its
 * collectives for the communication thread (fsdp_comm.c). */
#include <stdlib.h>
#include <string.h>

#include "fsdp_internal.h"

static int transition(sp_fsdp *f, sp_machine m, uint32_t unit, int to,
                      sp_diag *d) {
  int rc = sp_session_transition(f->s, m, unit, to, d);
  if (rc < 0)
    sp_diag_prefix(d, rc, "unit %u (%s)", unit, sp_fsdp_unit_name(f, unit));
  return rc;
}

/* ---- unshard with the limiter ---- */

/* A pool block for one of a unit's slots. */
static int take_slot(sp_fsdp *f, sp_mem_cat cat, size_t n, size_t esize,
                     uint8_t **slot, sp_diag *d) {
  void *p = NULL;
  int rc = sp_fsdp_take(f, cat, n, esize, &p, d);
  *slot = p;
  return rc;
}

static int issue_gather(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[ui];
  /* _FreeEventQueue: drop finished gathers, then block on the oldest while
   * the limit is reached */
  size_t k = 0;
  for (size_t i = 0; i < f->n_inflight; i++)
    if (!sp_fsdp_ticket_done(f, f->inflight[i]))
      f->inflight[k++] = f->inflight[i];
  f->n_inflight = k;
  while (f->n_inflight >= f->opts.max_inflight_gathers) {
    int rc = sp_fsdp_wait(f, f->inflight[0], d);
    if (rc < 0) return rc;
    memmove(f->inflight, f->inflight + 1,
            (f->n_inflight - 1) * sizeof *f->inflight);
    f->n_inflight--;
  }
  /* the unsharded slot, from the pool (a flat unit keeps its own): after
   * the wait, so the limiter bounds the slots of gathers in flight */
  if (!fu->full) {
    int rc = take_slot(f, SP_MEM_PARAMS, (size_t)fu->padded, fu->psize,
                       &fu->full, d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "unit %u (%s): unsharded parameters", ui,
                            sp_fsdp_unit_name(f, ui));
  }
  sp_fsdp_work w = {.kind = SP_WORK_GATHER, .unit = ui};
  if (!f->flat) {
    sp_comm_kind gk = sp_fsdp_gather_kind(f);
    uint64_t count = (uint64_t)fu->c;
    int rc = sp_fsdp_before_collective(f, gk, SP_OP_ALL_GATHER, ui, &count, d);
    if (rc < 0) return rc;
    if (rc == 1) {
      /* skipped (an injected fault): nothing issued, nothing reported */
      fu->gather_skipped = true;
      return 0;
    }
    if (count != (uint64_t)fu->c)
      return sp_diag_set(d, SP_EINVAL,
                         "unit %u: before_collective changed "
                         "an all-gather's count",
                         ui);
    sp_fsdp_fp_issue(f, &w, gk, SP_OP_ALL_GATHER, ui, fu->u->param_dtype,
                     count);
  }
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) return (int)t;
  fu->gather_ticket = t;
  f->inflight[f->n_inflight++] = t;
  f->stats.all_gathers++;
  if (f->n_inflight > f->stats.max_inflight)
    f->stats.max_inflight = f->n_inflight;
  return 0;
}

static int unshard(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[ui];
  if (!fu->has_data || fu->unsharded) return 0;
  /* the master is the unsharded parameter: nothing to gather or copy */
  if (fu->full_is_shard) {
    fu->unsharded = true;
    return 0;
  }
  if (fu->gather_ticket < 0) {
    int rc = issue_gather(f, ui, d);
    if (rc < 0) return rc;
    if (fu->gather_skipped) {
      fu->gather_skipped = false;
      fu->unsharded = true;
      return 0;
    }
  }
  int rc = sp_fsdp_wait(f, fu->gather_ticket, d);
  if (rc < 0) return rc;
  fu->gather_ticket = -1;
  fu->unsharded = true;
  return 0;
}

/* The views go away and, except for a flat unit (which keeps its unsharded
 * storage), the slot goes back to the pool. A gather still pending into it
 * (a prefetch nobody used) is waited for first: the comm thread must not
 * write a block the pool may hand out again. Its error, if any, is the
 * runtime's sticky one and the next call reports it. */
static void reshard(sp_fsdp *f, uint32_t ui) {
  sp_fsdp_unit *fu = &f->units[ui];
  if (fu->gather_ticket >= 0 && !f->flat) {
    (void)sp_fsdp_wait(f, fu->gather_ticket, NULL);
    fu->gather_ticket = -1;
  }
  fu->unsharded = false;
  fu->prefetched = false;
  if (!f->flat && fu->full) {
    (void)sp_fsdp_release(f, SP_MEM_PARAMS, fu->full);
    fu->full = NULL;
  }
}

/* ---- the gradient side of the limiter ----
 * A reduction holds the unit's unsharded gradient and its reduce buffers
 * until it is retired: its ticket waited for, then the blocks back to the
 * pool (a gradient that is the shard gradient stays). Retiring only when
 * the limit forces it or at finish_backward, never because a ticket
 * happens to be done already, makes what is held at every point a
 * function of the schedule alone, so the memory model (plan/memory.c)
 * predicts it exactly. */

static int retire_oldest(sp_fsdp *f, sp_diag *d) {
  uint32_t ui = f->reducing[0];
  memmove(f->reducing, f->reducing + 1,
          (f->n_reducing - 1) * sizeof *f->reducing);
  f->n_reducing--;
  sp_fsdp_unit *fu = &f->units[ui];
  int rc = 0;
  if (fu->reduce_ticket >= 0) {
    rc = sp_fsdp_wait(f, fu->reduce_ticket, d);
    fu->reduce_ticket = -1;
  }
  /* after a failure the comm thread runs nothing more, so the blocks are
   * free to go either way */
  (void)sp_fsdp_release(f, SP_MEM_REDUCE, fu->red_in);
  (void)sp_fsdp_release(f, SP_MEM_REDUCE, fu->red_out);
  fu->red_in = fu->red_out = NULL;
  if (!fu->grad_is_shard) {
    (void)sp_fsdp_release(f, SP_MEM_GRADS, fu->full_grad);
    fu->full_grad = NULL;
  }
  return rc;
}

/* Waits for the oldest reductions while as many as the limiter allows are
 * in flight, instead of holding one more gradient. */
static int limit_reductions(sp_fsdp *f, sp_diag *d) {
  while (f->n_reducing >= f->opts.max_inflight_gathers) {
    int rc = retire_oldest(f, d);
    if (rc < 0) return rc;
  }
  return 0;
}

/* FULL_SHARD and HYBRID_SHARD free after forward, except the root unit;
 * flat units hold nothing to free. */
static bool reshard_after_forward(const sp_fsdp *f, uint32_t ui) {
  return ui != 0 && !f->flat &&
         (f->plan->strategy == SP_FULL_SHARD ||
          f->plan->strategy == SP_HYBRID_SHARD);
}

static int check_unit(const sp_fsdp *f, uint32_t ui, sp_diag *d) {
  if (ui >= f->n_units)
    return sp_diag_set(d, SP_ERANGE, "unit %u out of range (%zu units)", ui,
                       f->n_units);
  return 0;
}

/* Refuses an illegal transition before the call acts on it: unshard issues
 * an all-gather, and a rank that issued one for a call it then refused
 * would leave its peers (which never issue it) out of step, or hang. Fails
 * with the session's message naming the legal states; changes nothing. */
static int check_transition(sp_fsdp *f, uint32_t ui, int to, sp_diag *d) {
  int from = sp_session_state(f->s, SP_MACHINE_HANDLE, ui);
  if (sp_state_transition_legal(SP_MACHINE_HANDLE, from, to)) return 0;
  return transition(f, SP_MACHINE_HANDLE, ui, to, d);
}

/* ---- the schedule ---- */

int sp_fsdp_pre_forward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  f->phase = SP_PHASE_FORWARD;
  int rc = check_unit(f, ui, d);
  if (rc == 0) rc = check_transition(f, ui, SP_HANDLE_FORWARD, d);
  if (rc == 0) rc = unshard(f, ui, d);
  if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_FORWARD, d);
  return rc;
}

int sp_fsdp_post_forward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  /* The table also allows IDLE -> IDLE and BACKWARD_PRE -> IDLE, but those
   * rows are finish_backward's (_post_backward_final_callback); a
   * post_forward from them would record a bogus post-forward order and
   * reshard a unit in use. */
  int from = rc == 0 ? sp_session_state(f->s, SP_MACHINE_HANDLE, ui) : 0;
  if (rc == 0 && from != SP_HANDLE_FORWARD)
    rc = sp_diag_set(d, SP_ESTATE,
                     "unit %u (%s): post_forward from %s; legal only from "
                     "FORWARD (after pre_forward)",
                     ui, sp_fsdp_unit_name(f, ui),
                     sp_state_name(SP_MACHINE_HANDLE, from));
  if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (fu->post_forward_index < 0 && f->n_order < f->n_units) {
    fu->post_forward_index = (int32_t)f->n_order;
    f->order[f->n_order++] = ui;
  }
  if (reshard_after_forward(f, ui)) reshard(f, ui);
  return 0;
}

int sp_fsdp_root_pre_forward(sp_fsdp *f, sp_diag *d) {
  int rc = sp_fsdp_lazy_init(f, d);
  if (rc == 0)
    rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD, d);
  if (rc == 0) rc = sp_fsdp_pre_forward(f, 0, d);
  return rc;
}

int sp_fsdp_root_post_forward(sp_fsdp *f, sp_diag *d) {
  int rc = sp_fsdp_post_forward(f, 0, d);
  if (rc == 0) rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  return rc;
}

int sp_fsdp_root_pre_backward(sp_fsdp *f, sp_diag *d) {
  int rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD, d);
  if (rc == 0) rc = sp_fsdp_pre_backward(f, 0, d);
  return rc;
}

/* BACKWARD_PRE prefetch: the unit before this one in post-forward order
 * (_get_handle_to_prefetch). */
static int prefetch(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int32_t idx = f->units[ui].post_forward_index;
  if (!f->opts.backward_prefetch || idx <= 0) return 0;
  uint32_t target = f->order[idx - 1];
  sp_fsdp_unit *tu = &f->units[target];
  if (!tu->has_data || tu->full_is_shard || tu->unsharded ||
      tu->gather_ticket >= 0 || tu->prefetched)
    return 0;
  /* FSDP prefetches only a handle that still needs its pre-backward
   * unshard (_needs_pre_backward_unshard): one whose backward already ran
   * (backward not in reverse forward order) would be gathered for nothing,
   * and its parameters left pending into the next step. */
  if (sp_session_state(f->s, SP_MACHINE_HANDLE, target) != SP_HANDLE_IDLE)
    return 0;
  int rc = issue_gather(f, target, d);
  if (rc < 0) return rc;
  tu->prefetched = true;
  f->stats.prefetches++;
  return 0;
}

int sp_fsdp_pre_backward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  f->phase = SP_PHASE_BACKWARD;
  int rc = check_unit(f, ui, d);
  if (rc == 0) rc = check_transition(f, ui, SP_HANDLE_BACKWARD_PRE, d);
  if (rc == 0) rc = unshard(f, ui, d);
  if (rc == 0)
    rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_BACKWARD_PRE, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  /* the trainer adds its gradient to the buffer (as autograd accumulates
   * into .grad): a zeroed slot, unless the buffer holds the gradients of
   * earlier backward passes without sync, to be added to and reduced
   * together (it stays taken from one micro-batch to the next). A shard
   * gradient that is the buffer is never zeroed here: like NO_SHARD's
   * .grad in FSDP it holds this step's gradient so far (the reductions of
   * earlier micro-batches, the gradients kept without sync), which the
   * trainer adds to and the next reduction includes. */
  if (fu->has_data && !fu->grad_unsynced && !fu->grad_is_shard) {
    /* the gradient slot, after waiting for the oldest reduction if the
     * limit is reached */
    if (!fu->full_grad) {
      rc = limit_reductions(f, d);
      if (rc == 0)
        rc = take_slot(f, SP_MEM_GRADS, (size_t)fu->padded, fu->psize,
                       &fu->full_grad, d);
      if (rc < 0)
        return sp_diag_prefix(d, rc, "unit %u (%s): unsharded gradient", ui,
                              sp_fsdp_unit_name(f, ui));
    }
    rc = f->mem->zero(f, SP_LANE_COMPUTE, fu->full_grad,
                      (size_t)fu->padded * fu->psize, d);
    if (rc < 0) return rc;
  }
  return prefetch(f, ui, d);
}

int sp_fsdp_post_backward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  f->phase = SP_PHASE_BACKWARD;
  int rc = check_unit(f, ui, d);
  /* BACKWARD_POST -> BACKWARD_POST is reentrant activation checkpointing
   * running the hook again: the gradient is already being reduced (and,
   * in place, pre-divided), so a second reduction would divide it twice */
  bool again = rc == 0 && sp_session_state(f->s, SP_MACHINE_HANDLE, ui) ==
                              SP_HANDLE_BACKWARD_POST;
  if (rc == 0)
    rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_BACKWARD_POST, d);
  if (rc < 0 || again) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (fu->reduces && !fu->full_grad)
    return sp_diag_set(d, SP_ESTATE,
                       "unit %u (%s): post_backward without "
                       "its gradient (pre_backward did not run?)",
                       ui, sp_fsdp_unit_name(f, ui));
  /* without gradient sync (FSDP's no_sync) the unsharded gradient stays,
   * unreduced and in its slot, for the next backward to add to */
  if (fu->reduces && f->no_sync) fu->grad_unsynced = true;
  if (fu->reduces && !f->no_sync) {
    fu->grad_unsynced = false;
    bool no_shard = f->flat;
    /* the oldest reductions first, while the limit is reached, then this
     * one's buffers */
    rc = limit_reductions(f, d);
    if (rc == 0 && fu->u->reduce_dtype != fu->u->param_dtype)
      rc = take_slot(f, SP_MEM_REDUCE, (size_t)fu->padded, fu->rsize,
                     &fu->red_in, d);
    if (rc == 0 && !no_shard)
      rc = take_slot(f, SP_MEM_REDUCE, (size_t)fu->c, fu->rsize, &fu->red_out,
                     d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "unit %u (%s): reduce buffers", ui,
                            sp_fsdp_unit_name(f, ui));
    sp_fsdp_work w = {.kind = SP_WORK_REDUCE, .unit = ui};
    sp_dtype rdt = fu->u->reduce_dtype;
    bool hybrid_ar = !no_shard && f->plan->strategy == SP_HYBRID_SHARD &&
                     f->replica_comm && sp_comm_size(f->replica_comm) > 1;
    sp_coll_op op = no_shard ? SP_OP_ALL_REDUCE : SP_OP_REDUCE_SCATTER;
    sp_comm_kind k = no_shard ? SP_COMM_WORLD : sp_fsdp_gather_kind(f);
    /* under a replica quorum groups of one rank sum over the replica
     * group, when it has more than this rank */
    bool main_op = true;
    if (no_shard && f->q_on) {
      k = SP_COMM_REPLICA;
      main_op = f->replica_comm && sp_comm_size(f->replica_comm) > 1;
    }
    uint64_t planned = (uint64_t)fu->c; /* flat: padded == c */
    uint64_t count = planned;
    rc = sp_fsdp_before_collective(f, k, op, ui, &count, d);
    if (rc == 0 && (count > planned || count == 0))
      rc = sp_diag_set(d, SP_EINVAL,
                       "unit %u: before_collective may only "
                       "lower a reduction's count (%llu, planned %llu)",
                       ui, (unsigned long long)count,
                       (unsigned long long)planned);
    if (rc == 0 && hybrid_ar) {
      uint64_t c2 = (uint64_t)fu->c;
      rc = sp_fsdp_before_collective(f, SP_COMM_REPLICA, SP_OP_ALL_REDUCE, ui,
                                     &c2, d);
      if (rc == 0 && c2 != (uint64_t)fu->c)
        rc = sp_diag_set(d, SP_EINVAL,
                         "unit %u: before_collective changed "
                         "the replica all-reduce's count",
                         ui);
    }
    if (rc != 0) return rc < 0 ? rc : SP_EINVAL;
    if (count != planned) w.count = (size_t)count;
    if (main_op) sp_fsdp_fp_issue(f, &w, k, op, ui, rdt, count);
    if (hybrid_ar)
      sp_fsdp_fp_issue(f, &w, SP_COMM_REPLICA, SP_OP_ALL_REDUCE, ui, rdt,
                       (uint64_t)fu->c);
    int64_t t = sp_fsdp_enqueue(f, &w, d);
    if (t < 0) return (int)t;
    fu->reduce_ticket = t;
    f->reducing[f->n_reducing++] = ui;
    if (no_shard) {
      f->stats.all_reduces++;
    } else {
      f->stats.reduce_scatters++;
      if (hybrid_ar) f->stats.all_reduces++;
    }
  } else if (fu->has_data && !fu->reduces && !fu->grad_is_shard) {
    /* a frozen unit: its gradient is not reduced, the slot goes at once */
    (void)sp_fsdp_release(f, SP_MEM_GRADS, fu->full_grad);
    fu->full_grad = NULL;
  }
  if (!f->flat) reshard(f, ui);
  return 0;
}

int sp_fsdp_finish_backward(sp_fsdp *f, sp_diag *d) {
  /* the table lets any handle state go to IDLE here (the final callback),
   * FORWARD included; but a unit still in forward means the caller is not
   * at the end of a backward pass */
  if (sp_session_state(f->s, SP_MACHINE_ROOT, 0) != SP_ROOT_FORWARD_BACKWARD)
    return sp_diag_set(
        d, SP_ESTATE,
        "finish_backward outside backward "
        "(root %s)",
        sp_state_name(SP_MACHINE_ROOT,
                      sp_session_state(f->s, SP_MACHINE_ROOT, 0)));
  for (uint32_t ui = 0; ui < f->n_units; ui++)
    if (sp_session_state(f->s, SP_MACHINE_HANDLE, ui) == SP_HANDLE_FORWARD)
      return sp_diag_set(d, SP_ESTATE,
                         "finish_backward during forward: "
                         "unit %u (%s) is in FORWARD",
                         ui, sp_fsdp_unit_name(f, ui));
  int rc = 0;
  while (rc == 0 && f->n_reducing > 0) rc = retire_oldest(f, d);
  for (uint32_t ui = 0; ui < f->n_units && rc == 0; ui++) {
    sp_fsdp_unit *fu = &f->units[ui];
    /* a unit prefetched but whose backward never ran: its gather holds
     * this step's parameters, and a pending ticket would make the next
     * forward's unshard reuse them after SGD changed the shard. Wait for it
     * (sgd_step must not write the shard it reads) and drop it. */
    if (rc == 0 && fu->gather_ticket >= 0) {
      rc = sp_fsdp_wait(f, fu->gather_ticket, d);
      fu->gather_ticket = -1;
    }
    if (rc == 0 &&
        sp_session_state(f->s, SP_MACHINE_HANDLE, ui) != SP_HANDLE_IDLE)
      rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
    /* _catch_all_reshard; and the gradient slot of a unit whose
     * post_backward never ran (one that ran without sync keeps it for the
     * next micro-batch) */
    if (!f->flat) reshard(f, ui);
    if (!fu->grad_unsynced && !fu->grad_is_shard) {
      (void)sp_fsdp_release(f, SP_MEM_GRADS, fu->full_grad);
      fu->full_grad = NULL;
    }
    fu->post_forward_index = -1;
  }
  f->n_order = 0;
  f->phase = SP_PHASE_OTHER;
  if (rc == 0) rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  return rc;
}

int sp_fsdp_all_reduce(sp_fsdp *f, void *buf, size_t count, sp_dtype dt,
                       sp_diag *d) {
  if (f->world == 1) return 0;
  sp_fsdp_work w = {
      .kind = SP_WORK_ALL_REDUCE, .buf = buf, .count = count, .dt = dt};
  uint64_t n = count;
  f->phase = SP_PHASE_OTHER;
  int rc =
      sp_fsdp_before_collective(f, SP_COMM_WORLD, SP_OP_ALL_REDUCE, 0, &n, d);
  if (rc == 0 && n != count)
    rc = sp_diag_set(d, SP_EINVAL,
                     "before_collective changed a caller's "
                     "all-reduce count");
  if (rc != 0) return rc < 0 ? rc : SP_EINVAL;
  if (!f->q_on) {
    sp_fsdp_fp_issue(f, &w, SP_COMM_WORLD, SP_OP_ALL_REDUCE, 0, dt, count);
  } else { /* the shard group's sum, then the replica group's */
    sp_fsdp_fp_issue(f, &w, SP_COMM_SHARD, SP_OP_ALL_REDUCE, 0, dt, count);
    if (f->replica_comm && sp_comm_size(f->replica_comm) > 1)
      sp_fsdp_fp_issue(f, &w, SP_COMM_REPLICA, SP_OP_ALL_REDUCE, 0, dt, count);
  }
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) return (int)t;
  f->stats.all_reduces++;
  return sp_fsdp_wait(f, t, d);
}

int sp_fsdp_gather_unit(sp_fsdp *f, uint32_t ui, void *dst, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (!fu->has_data) return 0;
  rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_SUMMON_FULL_PARAMS, d);
  if (rc < 0) return rc;
  /* a flat unit's master is the whole parameter already */
  if (f->flat) {
    rc =
        f->mem->to_host(f, dst, fu->shard, (size_t)fu->u->numel * fu->esize, d);
    if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
    return rc;
  }
  /* storage of the runtime's kind (the collective runs on it), from the
   * pool: a float32 model's master parameter is the size of its unsharded
   * slot, so a checkpoint between steps reuses the steps' blocks */
  void *tmp = NULL;
  rc = sp_fsdp_take(f, SP_MEM_PARAMS, (size_t)fu->padded, fu->esize, &tmp, d);
  if (rc < 0)
    return sp_diag_prefix(d, rc, "gathering unit %u (%s)", ui,
                          sp_fsdp_unit_name(f, ui));
  sp_fsdp_work w = {.kind = SP_WORK_GATHER_MASTER, .unit = ui, .buf = tmp};
  sp_fsdp_fp_issue(f, &w, sp_fsdp_gather_kind(f), SP_OP_ALL_GATHER, ui,
                   fu->u->dtype, (uint64_t)fu->c);
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) {
    (void)sp_fsdp_release(f, SP_MEM_PARAMS, tmp);
    return (int)t;
  }
  rc = sp_fsdp_wait(f, t, d);
  if (rc == 0)
    rc = f->mem->to_host(f, dst, tmp, (size_t)fu->u->numel * fu->esize, d);
  (void)sp_fsdp_release(f, SP_MEM_PARAMS, tmp);
  if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
  return rc;
}

int sp_fsdp_gather_tensor(sp_fsdp *f, uint32_t ui, const void *src, sp_dtype dt,
                          void *dst, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (!fu->has_data) return 0;
  size_t es = sp_dtype_size(dt);
  /* a flat unit's tensor is whole on every rank: no collective */
  if (f->flat)
    return f->mem->to_host(f, dst, src ? src : fu->shard,
                           (size_t)fu->padded * es, d);
  /* host storage: Gloo gathers into the caller's buffer, no second copy */
  void *buf = dst;
  if (f->mem->device) {
    rc = f->mem->alloc(f, (size_t)fu->padded, es, &buf, d);
    if (rc < 0) return sp_diag_prefix(d, rc, "gathering unit %u", ui);
  }
  sp_fsdp_work w = {.kind = SP_WORK_GATHER_MASTER,
                    .unit = ui,
                    .buf = buf,
                    .src = src ? src : fu->shard,
                    .dt = src ? dt : fu->u->dtype};
  sp_fsdp_fp_issue(f, &w, sp_fsdp_gather_kind(f), SP_OP_ALL_GATHER, ui, w.dt,
                   (uint64_t)fu->padded);
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  rc = t < 0 ? (int)t : sp_fsdp_wait(f, t, d);
  if (rc == 0 && buf != dst)
    rc = f->mem->to_host(f, dst, buf, (size_t)fu->padded * es, d);
  if (buf != dst) f->mem->release(f, buf);
  return rc;
}

int sp_fsdp_gather_param(sp_fsdp *f, int32_t param, void *dst, sp_diag *d) {
  if (!f || param < 0 || (size_t)param >= f->model->n_params)
    return sp_diag_set(d, SP_ERANGE, "parameter %d out of range", param);
  uint32_t ui = (uint32_t)f->plan->param_unit[param];
  sp_fsdp_unit *fu = &f->units[ui];
  const sp_flat_entry *e = &f->plan->entries[f->plan->param_entry[param]];
  uint8_t *full = sp_fsdp_xcalloc((size_t)fu->u->numel, fu->esize);
  if (!full) return sp_diag_set(d, SP_ENOMEM, "no memory");
  int rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS, d);
  if (rc == 0) rc = sp_fsdp_gather_unit(f, ui, full, d);
  if (rc == 0) rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  if (rc == 0)
    memcpy(dst, full + (size_t)e->offset * fu->esize,
           (size_t)e->numel * fu->esize);
  free(full);
  return rc;
}

/* ---- between steps: shards and gradients ---- */

int sp_fsdp_check_between_steps(sp_fsdp *f, const char *what, sp_diag *d) {
  int root = sp_session_state(f->s, SP_MACHINE_ROOT, 0);
  if (root != SP_ROOT_IDLE)
    return sp_diag_set(d, SP_ESTATE,
                       "%s: between steps only (root %s; "
                       "after finish_backward)",
                       what, sp_state_name(SP_MACHINE_ROOT, root));
  for (uint32_t ui = 0; ui < f->n_units; ui++) {
    int st = sp_session_state(f->s, SP_MACHINE_HANDLE, ui);
    if (st != SP_HANDLE_IDLE || f->units[ui].reduce_ticket >= 0)
      return sp_diag_set(
          d, SP_ESTATE,
          "%s: between steps only (unit %u "
          "(%s) is %s%s)",
          what, ui, sp_fsdp_unit_name(f, ui),
          sp_state_name(SP_MACHINE_HANDLE, st),
          f->units[ui].reduce_ticket >= 0 ? ", its reduction pending" : "");
  }
  return 0;
}

int sp_fsdp_unit_stale(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[ui];
  /* a gather still in flight read the old shard (or is reading it) */
  if (fu->gather_ticket >= 0) {
    int rc = sp_fsdp_wait(f, fu->gather_ticket, d);
    if (rc < 0) return rc;
    fu->gather_ticket = -1;
  }
  reshard(f, ui);
  return 0;
}

int sp_fsdp_shards_changed(sp_fsdp *f, sp_diag *d) {
  if (!f) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_shards_changed: NULL");
  int rc = sp_fsdp_check_between_steps(f, "sp_fsdp_shards_changed", d);
  for (uint32_t ui = 0; rc == 0 && ui < f->n_units; ui++)
    rc = sp_fsdp_unit_stale(f, ui, d);
  return rc;
}

int sp_fsdp_set_requires_gradient_sync(sp_fsdp *f, bool sync, sp_diag *d) {
  if (!f)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_fsdp_set_requires_gradient_sync: "
                       "NULL");
  int rc =
      sp_fsdp_check_between_steps(f, "sp_fsdp_set_requires_gradient_sync", d);
  if (rc == 0) f->no_sync = !sync;
  return rc;
}

bool sp_fsdp_requires_gradient_sync(const sp_fsdp *f) {
  return f && !f->no_sync;
}

/* The sharded gradients, and with `unsynced` the unsharded ones kept by
 * backward passes without sync. */
static int zero_grads(sp_fsdp *f, bool unsynced, sp_diag *d) {
  int rc = 0;
  for (uint32_t ui = 0; rc == 0 && ui < f->n_units; ui++) {
    sp_fsdp_unit *fu = &f->units[ui];
    if (!fu->has_data) continue;
    rc = f->mem->zero(f, SP_LANE_COMPUTE, fu->shard_grad,
                      (size_t)fu->c * sp_dtype_size(fu->grad_dtype), d);
    /* a slot goes back; a shard gradient that is the unsharded one was
     * just zeroed with its unsynced gradients, as NO_SHARD's .grad in
     * FSDP */
    if (rc == 0 && fu->grad_unsynced && (unsynced || fu->grad_is_shard)) {
      if (!fu->grad_is_shard) {
        (void)sp_fsdp_release(f, SP_MEM_GRADS, fu->full_grad);
        fu->full_grad = NULL;
      }
      fu->grad_unsynced = false;
    }
    if (rc < 0)
      sp_diag_prefix(d, rc, "zeroing the gradients of unit %u (%s)", ui,
                     sp_fsdp_unit_name(f, ui));
  }
  return rc;
}

int sp_fsdp_zero_grad(sp_fsdp *f, sp_diag *d) {
  if (!f) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_zero_grad: NULL");
  int rc = sp_fsdp_check_between_steps(f, "sp_fsdp_zero_grad", d);
  return rc < 0 ? rc : zero_grads(f, true, d);
}

int sp_fsdp_zero_shard_grads(sp_fsdp *f, sp_diag *d) {
  return zero_grads(f, false, d);
}

/* p -= lr * g, computed in double and rounded once to the master dtype, as
 * the reference trainer does (the memory ops' sgd without momentum or
 * decay); then zero_grad, and the shards changed. */
int sp_fsdp_sgd_step(sp_fsdp *f, double lr, sp_diag *d) {
  if (!f) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_sgd_step: NULL");
  int rc = sp_fsdp_check_between_steps(f, "sp_fsdp_sgd_step", d);
  if (rc == 0) rc = sp_fsdp_quorum_commit(f, d);
  for (size_t ui = 0; rc == 0 && ui < f->n_units; ui++) {
    sp_fsdp_unit *fu = &f->units[ui];
    if (!fu->reduces) continue;
    rc = f->mem->sgd(f, fu->shard, fu->u->dtype, fu->shard_grad, fu->grad_dtype,
                     NULL, (size_t)fu->c, lr, 0, 0, d);
    if (rc < 0)
      sp_diag_prefix(d, rc, "SGD on unit %zu (%s)", ui,
                     sp_fsdp_unit_name(f, (uint32_t)ui));
  }
  /* a unit that gets no gradient next step must not be moved again by
   * this one */
  if (rc == 0) rc = sp_fsdp_zero_shard_grads(f, d);
  if (rc == 0) rc = sp_fsdp_shards_changed(f, d);
  /* the step count checkpoints carry, so a resumed run continues its
   * schedule (and an optimizer with bias correction its own) */
  if (rc == 0) f->optim_steps++;
  return rc;
}
