/* The FSDP runtime's state, shared by its files (fsdp.c construction and
 * storage, fsdp_schedule.c the schedule, fsdp_comm.c the communication
 * thread, fsdp_mem_host.c and fsdp_cuda.c the memory-ops tables, optim.c
 * the optimizer and clipping) and by ckpt.c (checkpoints). Not part of the
 * public API. */
#ifndef SP_FSDP_INTERNAL_H
#define SP_FSDP_INTERNAL_H

#include <pthread.h>

#include "plan/memory.h"
#include "lib/shardplane.h"

/* also included by the runtime's CUDA kernels (C++) */
#ifdef __cplusplus
extern "C" {
#endif

typedef struct sp_fsdp_shard_state sp_fsdp_shard_state;
/* The optimizer's state (optim.c): hyperparameters, moments, decay masks. */
typedef struct sp_fsdp_optim sp_fsdp_optim;
typedef struct sp_fsdp_adamw_args sp_fsdp_adamw_args;

typedef struct sp_fsdp_unit {
  const sp_unit *u;
  bool has_data;       /* the unit owns parameters */
  bool reduces;        /* has_data and any parameter requires grad */
  size_t esize;        /* unit (master) dtype size */
  size_t psize;        /* param_dtype size */
  int64_t c;           /* shard elements, padding included */
  int64_t padded;      /* c * shard_world (NO_SHARD: c) */
  size_t rsize;        /* reduce_dtype size */
  uint8_t *shard;      /* c, master dtype */
  uint8_t *shard_grad; /* c, grad_dtype */
  sp_dtype grad_dtype;
  /* A flat unit (f->flat) holds its whole flat parameter, so, as FSDP's
   * NO_SHARD, it keeps no second copy of what it already has: full is
   * shard itself when param_dtype is the unit dtype, and full_grad is
   * shard_grad itself when the gradient keeps param_dtype (no mixed
   * precision, or keep_low_precision_grads). The trainer then writes the
   * gradient where the optimizer reads it, and the reduction runs there
   * in place. */
  bool full_is_shard;
  bool grad_is_shard;
  /* Slots: pool blocks the unit holds only while it needs them (docs/
   * fsdp.md, "Memory"); NULL otherwise. A flat unit whose full is not its
   * shard keeps that low-precision copy from sp_fsdp_new to sp_fsdp_free
   * (it never reshards within a step); its full_grad, when not the shard
   * gradient, is a slot as for the other strategies. The shard is cast
   * (or copied) into its own place of full and gathered in place, so
   * mixed precision needs no separate low-precision shard. */
  uint8_t *full;      /* padded, param_dtype: from the all-gather's issue
                         to reshard */
  uint8_t *full_grad; /* padded, param_dtype: from pre_backward until the
                         reduction is retired */
  uint8_t *red_in;    /* padded, reduce_dtype, only when it differs from
                         param_dtype: from post_backward until retired */
  uint8_t *red_out;   /* c, reduce_dtype: likewise (a flat unit reduces in
                         place and has none) */
  bool unsharded;     /* full holds this step's gathered parameters */
  /* full_grad holds gradients of backward passes run without gradient
   * sync (sp_fsdp_set_requires_gradient_sync), not reduced yet: the next
   * pre_backward keeps them for the trainer to add to */
  bool grad_unsynced;
  bool prefetched;
  int64_t gather_ticket;      /* pending all-gather, or -1 */
  bool gather_skipped;        /* before_collective skipped the last gather */
  int64_t reduce_ticket;      /* pending reduction, or -1 */
  int32_t post_forward_index; /* in this iteration's order, -1 */
} sp_fsdp_unit;

/* Where the runtime's tensors live and how they move: one small table, so
 * the schedule below is written once for host and device memory.
 *
 * Two lanes order the work. The compute lane is the training thread's: on a
 * GPU the runtime's compute stream, on which the trainer also runs its
 * kernels (sp_fsdp_cuda_stream). The comm lane is the communication
 * thread's own stream. A work item records a mark on the compute lane when
 * it is queued and the comm lane waits for that mark before running it, so
 * a collective sees everything the trainer issued before queueing it. A
 * work item is complete (its ticket done) only when its comm-lane work has
 * finished on the device, so after sp_fsdp_wait its results may be used on
 * any stream. On the CPU every operation is synchronous and lanes and marks
 * are no-ops.
 *
 * Every function returns 0 or a negative SP_E* code with d (which may be
 * NULL) filled. Pointers are runtime storage (host or device) unless named
 * host. */
typedef enum sp_fsdp_lane {
  SP_LANE_COMPUTE = 0,
  SP_LANE_COMM = 1,
} sp_fsdp_lane;

typedef struct sp_fsdp_mem_ops {
  const char *name; /* "cpu", "cuda" */
  bool device;      /* storage is device memory, not host-addressable */
  /* n elements of esize bytes, zero-filled; n == 0 gives a valid pointer.
   * SP_ETOOBIG when n * esize overflows, SP_ENOMEM / SP_ECUDA. */
  int (*alloc)(sp_fsdp *f, size_t n, size_t esize, void **out, sp_diag *d);
  void (*release)(sp_fsdp *f, void *p); /* NULL is fine */
  int (*zero)(sp_fsdp *f, sp_fsdp_lane l, void *p, size_t bytes, sp_diag *d);
  int (*copy)(sp_fsdp *f, sp_fsdp_lane l, void *dst, const void *src,
              size_t bytes, sp_diag *d);
  /* sp_cast's rules and bits (RNE, NaN kept) */
  int (*cast)(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
              const void *src, sp_dtype st, size_t n, sp_diag *d);
  /* buf /= div in place, the quotient computed in double and rounded once
   * (float32, float64) or via float32 (16-bit dtypes) */
  int (*scale_div)(sp_fsdp *f, sp_fsdp_lane l, void *buf, sp_dtype dt, size_t n,
                   double div, sp_diag *d);
  /* dst (dt) = rne_dt(dst + cast_dt(src (st) / div)), the sum in double:
   * the reduced gradient's post-divide, cast to the shard gradient's dtype
   * and accumulation into it (FSDP2: a micro-batch's gradient is added to
   * the sharded gradient until the optimizer step or zero_grad clears it;
   * onto a zero gradient it is exactly the cast quotient). The quotient
   * follows scale_div's rule; src is overwritten with it. */
  int (*acc_div)(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt, void *src,
                 sp_dtype st, size_t n, double div, sp_diag *d);
  /* g = rne_gdt(g * k), the product in double: gradient clipping */
  int (*scale)(sp_fsdp *f, sp_fsdp_lane l, void *g, sp_dtype gdt, size_t n,
               double k, sp_diag *d);
  /* *out (one double of storage) = the sum of the squares of g's n
   * elements in double, in the fixed order of sp_fsdp_sqsum_ref (each
   * square is exact; the sums round), so host and device give the same
   * bits. partial: storage of sp_fsdp_sqsum_chunks(n) doubles (the device
   * needs it, the host ignores it). Compute lane. */
  int (*sqsum)(sp_fsdp *f, const void *g, sp_dtype gdt, size_t n,
               double *partial, double *out, sp_diag *d);
  /* The optimizer updates on n elements of a master shard, compute lane,
   * every operation in double in the order written (no FMA), stored
   * values rounded once (RNE) to their dtype; g is not changed:
   * sgd:   gv = g + wd * p;  with buf: b = rne_f32(momentum * b + gv),
   *        gv = b;  p = rne(p - lr * gv)   (torch.optim.SGD, dampening 0)
   * adamw: sp_fsdp_adamw_args */
  int (*sgd)(sp_fsdp *f, void *p, sp_dtype pdt, const void *g, sp_dtype gdt,
             float *buf, size_t n, double lr, double momentum, double wd,
             sp_diag *d);
  int (*adamw)(sp_fsdp *f, void *p, sp_dtype pdt, const void *g, sp_dtype gdt,
               float *m, float *v, size_t n, const sp_fsdp_adamw_args *a,
               sp_diag *d);
  /* Synchronous copies between host memory and storage, ordered after
   * everything issued on the compute lane. */
  int (*to_host)(sp_fsdp *f, void *host, const void *src, size_t bytes,
                 sp_diag *d);
  int (*from_host)(sp_fsdp *f, void *dst, const void *host, size_t bytes,
                   sp_diag *d);
  /* Training thread, when work is queued into ring slot `slot`: marks the
   * compute lane. Comm thread, before running that slot: makes the comm
   * lane wait for the mark. */
  int (*mark)(sp_fsdp *f, size_t slot, sp_diag *d);
  int (*wait_mark)(sp_fsdp *f, size_t slot, sp_diag *d);
  /* Blocks the calling thread until the lane's work has finished. */
  int (*drain)(sp_fsdp *f, sp_fsdp_lane l, sp_diag *d);
  /* Comm thread, before a collective: makes `stream` (the communicator's
   * cudaStream_t) wait for the comm lane's work so far (an event, not a
   * host wait). */
  int (*handoff)(sp_fsdp *f, void *stream, sp_diag *d);
  /* Once, on the communication thread before its first item (a CUDA
   * device is current per thread). NULL: nothing to do. */
  int (*thread_init)(sp_fsdp *f, sp_diag *d);
  /* Frees the lanes (after every storage release). */
  void (*destroy)(sp_fsdp *f);
} sp_fsdp_mem_ops;

/* One AdamW update (torch.optim.AdamW), element by element in double:
 *   p  = p - lrwd * p                       (decoupled decay; lrwd = lr*wd,
 *                                            0 for a no-decay element)
 *   m  = rne_f32(beta1 * m + omb1 * g)       (omb1 = 1 - beta1)
 *   v  = rne_f32(beta2 * v + omb2 * (g * g)) (omb2 = 1 - beta2)
 *   mh = m / bc1,  vh = v / bc2              (bc = 1 - beta^t, t from 1)
 *   p  = rne(p - (lr * mh) / (sqrt(vh) + eps))
 * with m and v the stored float32 values. Every constant is computed once
 * on the host, so host and device see the same doubles. */
struct sp_fsdp_adamw_args {
  double lr, lrwd, beta1, omb1, beta2, omb2, bc1, bc2, eps;
};

/* The summation order of the sum of squares (mem ops sqsum): chunks of
 * SP_FSDP_SQ_CHUNK elements; within a chunk SP_FSDP_SQ_LANES lanes, lane t
 * summing elements t, t + LANES, t + 2 LANES, ... of the chunk in order,
 * then the lanes pairwise (for s = LANES/2 down to 1: lane[t] += lane[t+s]
 * for t < s); the chunk sums then in chunk order. It is a GPU block's
 * natural order (a lane per thread, a shared-memory tree), written out
 * for the CPU. */
#define SP_FSDP_SQ_LANES 256
#define SP_FSDP_SQ_CHUNK (SP_FSDP_SQ_LANES * 16)
size_t sp_fsdp_sqsum_chunks(size_t n);
/* The host reference of that order (fsdp_mem_host.c). */
double sp_fsdp_sqsum_ref(const void *g, sp_dtype gdt, size_t n);

/* The host implementations (fsdp_mem_host.c): "cpu", and "cpu-staged",
 * host memory the runtime treats as a device's (mem.device), so a machine
 * without a GPU runs the staging paths a GPU takes. */
extern const sp_fsdp_mem_ops sp_fsdp_host_ops;
extern const sp_fsdp_mem_ops sp_fsdp_staged_ops;

/* The device implementation (fsdp_cuda.c): parses "cuda:N", makes N the
 * calling thread's device, creates the compute and comm streams and one
 * mark event per ring slot (f->queue_cap), and sets f->mem and f->dev.
 * SP_EUNSUPPORTED in a build without CUDA, SP_ENODEV without the device. */
int sp_fsdp_cuda_attach(sp_fsdp *f, const char *device, sp_diag *d);

/* One collective queued for the communication thread. */
typedef enum sp_fsdp_work_kind {
  SP_WORK_GATHER = 1,        /* unshard a unit */
  SP_WORK_REDUCE = 2,        /* reduce a unit's gradient */
  SP_WORK_ALL_REDUCE = 3,    /* a caller's buffer over the world */
  SP_WORK_GATHER_MASTER = 4, /* master shards into a caller's buffer */
  /* a caller's buffer summed over the shard group (the world for
   * FULL_SHARD and SHARD_GRAD_OP, the shard group for HYBRID_SHARD; not
   * queued when f->flat): a gradient norm, whose replicas hold equal
   * shards and must be counted once */
  SP_WORK_SHARD_ALL_REDUCE = 5,
} sp_fsdp_work_kind;

/* One collective of a work item as reported: its seq on its communicator
 * kind, and when it returned (set by the communication thread; 0: it did
 * not, or failed). The training thread reports the completion when it sees
 * the ticket done (sp_fsdp_wait, _ticket_done, _enqueue), since only it
 * may write the session's queue. */
typedef struct sp_fsdp_fp {
  uint64_t seq;
  uint64_t done_us;
  uint8_t comm;
} sp_fsdp_fp;

typedef struct sp_fsdp_work {
  sp_fsdp_work_kind kind;
  uint32_t unit;
  void *buf;
  size_t count; /* REDUCE: the reduced count when an injected fault
                   lowered it, else 0 (the unit's c) */
  sp_dtype dt;
  /* GATHER_MASTER: the per-rank tensor gathered (c elements of dt), NULL
   * for the master shard itself */
  const void *src;
  sp_fsdp_fp fp[2];
  uint8_t n_fp;
} sp_fsdp_work;

struct sp_fsdp {
  const sp_fsdp_mem_ops *mem; /* host or device storage */
  void *dev;                  /* the device implementation's state */
  /* every block of storage, counted by category (sp_fsdp_alloc / _take /
   * _release); the training thread's alone */
  sp_mem_pool pool;
  sp_session *s;
  const sp_plan *plan;
  const sp_model *model;
  uint32_t rank, world;
  /* The shard group is this rank alone (NO_SHARD, which every world of
   * one rank is, or HYBRID_SHARD with groups of one): every unit is flat
   * and the runtime runs NO_SHARD's schedule, what FSDP runs when it
   * would shard over one rank; the gradient is all-reduced over the world
   * (with groups of one, HYBRID_SHARD's replica group is the world). */
  bool flat;
  sp_comm *world_comm, *shard_comm, *replica_comm;
  sp_fsdp_opts opts;
  sp_fsdp_unit *units;
  size_t n_units;
  /* buffers, in their current dtype (compute dtype after lazy init) */
  uint8_t **buffers;
  sp_dtype *buffer_dtype;
  bool lazy_init_done;
  double pre_divide, post_divide;
  /* post-forward order of this iteration */
  uint32_t *order;
  size_t n_order;
  /* all-gathers in flight, oldest first (tickets) */
  int64_t *inflight;
  size_t n_inflight;
  /* reductions queued whose buffers are still held, oldest first (units):
   * at most max_inflight_gathers, the limiter's bound on the gradient
   * side */
  uint32_t *reducing;
  size_t n_reducing;
  sp_fsdp_stats stats;
  /* per-unit state sharded like the master shards (an optimizer's
   * moments), which checkpoints save and load; and the optimizer steps
   * taken, which they carry so a resumed run continues its schedule */
  sp_fsdp_shard_state *states;
  size_t n_states;
  uint64_t optim_steps;
  /* the optimizer (sp_fsdp_optim_init), NULL before; freed with f */
  sp_fsdp_optim *optim;
  /* sp_fsdp_set_requires_gradient_sync(f, false): post_backward reduces
   * nothing and unsharded gradients accumulate (FSDP's no_sync) */
  bool no_sync;

  /* the communication thread: a FIFO of work with increasing tickets */
  pthread_t thread;
  bool thread_started;
  /* no thread: sp_fsdp_enqueue runs the work itself (a world of one on
   * host storage, sp_fsdp_comm_start) */
  bool inline_comm;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sp_fsdp_work *queue; /* ring of queue_cap */
  size_t queue_cap;
  int64_t issued;     /* tickets handed out: next is issued */
  int64_t completed;  /* tickets [0, completed) finished */
  int64_t reported;   /* tickets whose completions went to the session */
  uint64_t waited_us; /* training-thread wait not yet reported */
  /* nanoseconds the thread spent running work, under mu; the trainer's
   * thread copies it into stats.comm_busy_s whenever it takes mu */
  uint64_t comm_busy_ns;
  /* what the trainer is in, for the fault-injection hook */
  sp_fsdp_phase phase;
  bool stopping;
  int error; /* first failure, sticky */
  sp_diag error_diag;

  /* Replica groups that continue (fsdp_quorum.c): q_on when the runtime
   * forms the replica group itself, per quorum of the coordinator. */
  bool q_on;
  /* a replica collective of this step failed (set by the communication
   * thread, read by the training thread after its wait): the replica
   * collectives left are skipped and the step is discarded at the commit */
  bool q_broken;
  bool q_joiner;    /* a process that has not received the live state */
  bool q_formed;    /* replica_comm belongs to epoch q_epoch */
  uint64_t q_epoch; /* the quorum the replica group was formed for */
  uint64_t q_tried; /* the last epoch this rank tried to form (+1) */
  uint32_t q_group, q_shard, q_groups, q_members, q_gen;
  bool *q_in;       /* per group: in the quorum formed (q_groups entries) */
  uint32_t *q_list; /* an epoch's groups, as read (q_groups entries) */
  uint64_t q_timeout_ms;   /* a replica group's forming and collectives */
  char q_host[64];         /* the Gloo address, as sp_fsdp_comms_open chose */
  char q_why[SP_DIAG_MAX]; /* the replica failure, for the log */
  /* replica_comm's replacement against the session thread's abort of it
   * (on_quorum in fsdp_quorum.c) */
  pthread_mutex_t q_mu;
  bool q_mu_init;
};

/* The gradient's division in two (before and after the sum) for a sum
 * over `world` ranks, as FSDP splits it. */
void sp_fsdp_divide_factors(uint32_t world, double *pre, double *post);
/* Replica groups that continue (fsdp_quorum.c): sp_fsdp_new's part, and
 * the commit of a step (0, or SP_EAGAIN with the gradients cleared when a
 * replica collective failed in any rank of this shard group). */
int sp_fsdp_quorum_init(sp_fsdp *f, sp_diag *d);
/* Whether the coordinator keeps a replica quorum for this job (its key
 * "quorum/epoch" exists), and group's generation (how often it was
 * dropped: its shard group's name). */
int sp_fsdp_quorum_probe(sp_session *s, uint32_t group, bool *on, uint32_t *gen,
                         sp_diag *d);
/* The options every communicator of the session's job is opened with
 * (backend, store, device, the address peers reach it at, in host). */
int sp_fsdp_comm_opts(sp_session *s, uint64_t timeout_ms, sp_comm_opts *o,
                      char *host, size_t cap, sp_diag *d);
int sp_fsdp_quorum_commit(sp_fsdp *f, sp_diag *d);
void sp_fsdp_quorum_free(sp_fsdp *f);
/* Checkpoints under a replica quorum: the ranks whose files this rank
 * writes (*n of them, malloc'd: the caller frees; NULL: no memory): itself,
 * and for a rank of the first group in the quorum the ranks at its shard
 * index of the groups out of it (they hold the same shards), so that a
 * checkpoint has every rank's piece while a group is out; and the rank
 * that does rank 0's part (the staging directory, the FULL file, the
 * index, the publishing): the first rank of the first group in the
 * quorum. Without a quorum: the rank itself, and rank 0. */
uint32_t *sp_fsdp_ckpt_ranks(const sp_fsdp *f, size_t *n);
uint32_t sp_fsdp_ckpt_lead(const sp_fsdp *f);
/* A replica collective's failure under the quorum: remembered (the step
 * is discarded), not the runtime's sticky error. */
void sp_fsdp_quorum_failed(sp_fsdp *f, const sp_diag *why);

/* Starts the communication thread (fsdp_comm.c) once the storage is
 * allocated; _stop lets it drain the queue and joins it (nothing to do if
 * it never started). */
int sp_fsdp_comm_start(sp_fsdp *f, sp_diag *d);
void sp_fsdp_comm_stop(sp_fsdp *f);
/* A state tensor sharded exactly like the master shards: for every unit
 * with parameters, c elements of `dtype` (padding included, zero there),
 * in the runtime's storage (device memory on a GPU). Registered by whoever
 * owns it (the optimizer), which keeps the storage; checkpoints save and
 * load every registered state under "optim.<name>.<fqn>" (FULL, SHARDED)
 * or "<unit>.optim.<name>" (LOCAL). */
struct sp_fsdp_shard_state {
  char name[32]; /* "exp_avg", "exp_avg_sq", "momentum_buffer" */
  sp_dtype dtype;
  uint8_t **per_unit; /* n_units pointers; NULL for a unit without data */
};
/* States are added by sp_fsdp_register_shard_state (shardplane.h). */

/* Frees the optimizer's state (optim.c); from sp_fsdp_free, before the
 * storage goes. NULL optimizer: nothing. */
void sp_fsdp_optim_release(sp_fsdp *f);
/* Unit u's master shard changed (a load, an optimizer step): an unsharded
 * copy kept across steps (a flat unit's low-precision one, or a gather not
 * consumed yet) must not be served again. Waits for a pending gather of
 * u. */
int sp_fsdp_unit_stale(sp_fsdp *f, uint32_t u, sp_diag *d);
/* SP_ESTATE naming `what` unless the root and every unit are IDLE and no
 * reduction is pending: the calls that change shards or gradients run
 * between steps. */
int sp_fsdp_check_between_steps(sp_fsdp *f, const char *what, sp_diag *d);
/* The optimizer step's zero_grad: every sharded gradient (compute lane);
 * unsharded gradients kept without sync stay (sp_fsdp_zero_grad clears
 * those too), unless they are the sharded gradient itself (a flat unit's
 * grad_is_shard), which FSDP's NO_SHARD clears with the rest too. */
int sp_fsdp_zero_shard_grads(sp_fsdp *f, sp_diag *d);

/* The communicator kind of the unshard and of the shard-group sums. */
sp_comm_kind sp_fsdp_gather_kind(const sp_fsdp *f);
/* Reports the issue of one of w's collectives (before w is queued) and
 * remembers its seq in w for the completion. */
void sp_fsdp_fp_issue(sp_fsdp *f, sp_fsdp_work *w, sp_comm_kind k,
                      sp_coll_op op, uint32_t unit, sp_dtype dt,
                      uint64_t count);
/* Runs sp_fsdp_opts.before_collective, when there is one: 0 go on, 1 skip
 * (an all-gather only), or a negative SP_E* code. *count may come back
 * changed. */
int sp_fsdp_before_collective(sp_fsdp *f, sp_comm_kind k, sp_coll_op op,
                              uint32_t unit, uint64_t *count, sp_diag *d);

/* Queues work and returns its ticket (>= 0) or a negative error. */
int64_t sp_fsdp_enqueue(sp_fsdp *f, const sp_fsdp_work *w, sp_diag *d);
/* Waits until ticket completed; returns the runtime's first error. */
int sp_fsdp_wait(sp_fsdp *f, int64_t ticket, sp_diag *d);
/* Whether ticket has completed, without waiting. */
bool sp_fsdp_ticket_done(sp_fsdp *f, int64_t ticket);
/* Summons unit u's full master parameter (unit dtype, N elements) into dst
 * (host memory, also for a runtime on a GPU):
 * a collective over the shard group; reports SUMMON_FULL_PARAMS around it
 * (the caller moves the root into and out of SUMMON_FULL_PARAMS). */
int sp_fsdp_gather_unit(sp_fsdp *f, uint32_t u, void *dst, sp_diag *d);
/* Gathers one tensor of unit u sharded like the master (src: c elements
 * of dt in the runtime's storage, e.g. a registered state; NULL: the master
 * shard, in the unit dtype) over the shard group into dst, host memory of
 * c * W_s elements: every rank's shard, padding included. On host storage
 * the collective writes dst itself; on a device it goes through a
 * temporary of the same size in device memory. The caller moves the unit
 * (and the root) into SUMMON_FULL_PARAMS around it; a collective. */
int sp_fsdp_gather_tensor(sp_fsdp *f, uint32_t u, const void *src, sp_dtype dt,
                          void *dst, sp_diag *d);
/* Original dtype of a buffer, and its element count. */
sp_dtype sp_fsdp_buffer_orig_dtype(const sp_fsdp *f, int32_t b);
/* Runs lazy init if it has not run (buffers to compute dtype). */
int sp_fsdp_lazy_init(sp_fsdp *f, sp_diag *d);

/* Checkpoint access to the runtime's storage, so ckpt.c reads and writes
 * host memory whatever the device.
 * _host: a host image of unit u's master shard (c elements, unit dtype) or
 *   of buffer b (current dtype): on the CPU the storage itself (*owned =
 *   NULL), on a GPU a malloc'd copy (*owned = *data; the caller frees it).
 * _stage / _commit: a writable host image to load into (contents
 *   undefined): on the CPU the storage itself; on a GPU a malloc'd buffer
 *   that _commit uploads when `keep` and frees. NULL from _stage: SP_ENOMEM
 *   in d. */
int sp_fsdp_shard_host(sp_fsdp *f, uint32_t u, const uint8_t **data,
                       uint8_t **owned, sp_diag *d);
int sp_fsdp_buffer_host(sp_fsdp *f, int32_t b, const uint8_t **data,
                        uint8_t **owned, sp_diag *d);
uint8_t *sp_fsdp_shard_stage(sp_fsdp *f, uint32_t u, sp_diag *d);
int sp_fsdp_shard_commit(sp_fsdp *f, uint32_t u, uint8_t *stage, bool keep,
                         sp_diag *d);
uint8_t *sp_fsdp_buffer_stage(sp_fsdp *f, int32_t b, sp_diag *d);
int sp_fsdp_buffer_commit(sp_fsdp *f, int32_t b, uint8_t *stage, bool keep,
                          sp_diag *d);

/* The runtime's storage, host or device (f->mem), counted in f->pool by
 * category (plan/memory.h); every block of it goes through these, on the
 * training thread.
 * _alloc: a block of its own, zero-filled, for state that lives until
 *   released (shards, optimizer state, buffers). SP_ETOOBIG when n * esize
 *   overflows (checked before allocating), SP_ENOMEM / SP_ECUDA; d names
 *   the category and the size.
 * _take: a block from the pool's cache, exactly n * esize bytes, contents
 *   undefined, allocated only when no cached block fits (so a step that
 *   repeats the last allocates nothing). On a GPU it may still be read by
 *   work queued on the compute lane before the release: reuse it on the
 *   compute lane, or on the comm lane through a queued work item (whose
 *   mark orders it after the compute lane).
 * _release: a taken block back to the cache, an own block to the
 *   allocator; NULL is fine. SP_EINVAL when p is not the runtime's or not
 *   of cat (released anyway). */
int sp_fsdp_alloc(sp_fsdp *f, sp_mem_cat cat, size_t n, size_t esize, void **p,
                  sp_diag *d);
int sp_fsdp_take(sp_fsdp *f, sp_mem_cat cat, size_t n, size_t esize, void **p,
                 sp_diag *d);
int sp_fsdp_release(sp_fsdp *f, sp_mem_cat cat, void *p);

/* calloc that gives a unique pointer for zero elements and NULL (not a
 * wrapped size) when n * size overflows. */
void *sp_fsdp_xcalloc(size_t n, size_t size);
/* A unit's name in messages: its module FQN, "root" for the root. */
const char *sp_fsdp_unit_name(const sp_fsdp *f, uint32_t unit);

#ifdef __cplusplus
}
#endif

#endif
