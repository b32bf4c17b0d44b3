/* The FSDP runtime's state, shared by fsdp.c (schedule, collectives) and
 * ckpt.c (checkpoints). Not part of the public API. */
#ifndef SP_FSDP_INTERNAL_H
#define SP_FSDP_INTERNAL_H

#include <pthread.h>

#include "shardplane.h"

typedef struct sp_fsdp_unit {
  const sp_unit *u;
  bool has_data;      /* the unit owns parameters */
  bool reduces;       /* has_data and requires_grad */
  size_t esize;       /* unit (master) dtype size */
  size_t psize;       /* param_dtype size */
  int64_t c;          /* shard elements, padding included */
  int64_t padded;     /* c * shard_world (NO_SHARD: c) */
  uint8_t *shard;     /* c, master dtype */
  uint8_t *shard_grad;/* c, grad_dtype */
  sp_dtype grad_dtype;
  uint8_t *mp_shard;  /* c, param_dtype; NULL when equal to the master */
  uint8_t *full;      /* padded, param_dtype */
  uint8_t *full_grad; /* padded, param_dtype */
  uint8_t *red_in;    /* padded, reduce_dtype; NULL when == param_dtype */
  uint8_t *red_out;   /* c, reduce_dtype */
  bool unsharded;     /* full holds this step's gathered parameters */
  bool prefetched;
  int64_t gather_ticket; /* pending all-gather, or -1 */
  int64_t reduce_ticket; /* pending reduction, or -1 */
  int32_t post_forward_index; /* in this iteration's order, -1 */
} sp_fsdp_unit;

/* One collective queued for the communication thread. */
typedef enum sp_fsdp_work_kind {
  SP_WORK_GATHER = 1,     /* unshard a unit */
  SP_WORK_REDUCE = 2,     /* reduce a unit's gradient */
  SP_WORK_ALL_REDUCE = 3, /* a caller's buffer over the world */
  SP_WORK_GATHER_MASTER = 4, /* master shards into a caller's buffer */
} sp_fsdp_work_kind;

typedef struct sp_fsdp_work {
  sp_fsdp_work_kind kind;
  uint32_t unit;
  void *buf;
  size_t count;
  sp_dtype dt;
} sp_fsdp_work;

struct sp_fsdp {
  sp_session *s;
  const sp_plan *plan;
  const sp_model *model;
  uint32_t rank, world;
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
  sp_fsdp_stats stats;

  /* the communication thread: a FIFO of work with increasing tickets */
  pthread_t thread;
  bool thread_started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sp_fsdp_work *queue; /* ring of queue_cap */
  size_t queue_cap;
  int64_t issued;    /* tickets handed out: next is issued */
  int64_t completed; /* tickets [0, completed) finished */
  bool stopping;
  int error;         /* first failure, sticky */
  sp_diag error_diag;
};

/* Queues work and returns its ticket (>= 0) or a negative error. */
int64_t sp_fsdp_enqueue(sp_fsdp *f, const sp_fsdp_work *w, sp_diag *d);
/* Waits until ticket completed; returns the runtime's first error. */
int sp_fsdp_wait(sp_fsdp *f, int64_t ticket, sp_diag *d);
/* Summons unit u's full master parameter (unit dtype, N elements) into dst:
 * a collective over the shard group; reports SUMMON_FULL_PARAMS around it
 * (the caller moves the root into and out of SUMMON_FULL_PARAMS). */
int sp_fsdp_gather_unit(sp_fsdp *f, uint32_t u, void *dst, sp_diag *d);
/* Original dtype of a buffer, and its element count. */
sp_dtype sp_fsdp_buffer_orig_dtype(const sp_fsdp *f, int32_t b);
/* Runs lazy init if it has not run (buffers to compute dtype). */
int sp_fsdp_lazy_init(sp_fsdp *f, sp_diag *d);

#endif
