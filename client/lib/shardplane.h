/* libshardplane: the C API a training program links.
 *
 * A worker process is one rank of a job. It
 *   1. opens a session (sp_session_open): connects to the coordinator,
 *      fetches the job and the model spec, builds the plan locally and checks
 *      that its version equals the coordinator's, attaches, and starts a
 *      background thread that keeps the Session stream (heartbeats, batched
 *      transitions and collective fingerprints up; ABORT down);
 *   2. creates communicators (sp_comm_*) whose rendezvous goes through the
 *      coordinator's store (no other side channel, no fixed ports);
 *   3. creates the FSDP runtime (sp_fsdp_*) that owns the flat-parameter
 *      shards and runs unshard / reshard / gradient reduction per unit, in
 *      the schedule of the job's sharding strategy, reporting every
 *      transition and collective through the session;
 *   4. trains, saves and loads checkpoints (sp_ckpt_*), closes everything.
 *
 * Conventions (as the rest of shardplane): every fallible function returns
 * 0 or a negative SP_E* code (sp_error.h, sp_strerror) and, when given an
 * sp_diag, a message naming the rank, unit, FQN, file or key at fault.
 * Nothing here calls exit() or aborts the process. Objects are created by
 * ..._open / ..._new and released by the matching ..._close / ..._free, which accept
 * NULL. Unless a function says otherwise an object is used by one thread at
 * a time (the training thread).
 */
#ifndef SHARDPLANE_H
#define SHARDPLANE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "cast/dtype.h"
#include "plan/job.h"
#include "plan/memory.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "plan/state.h"
#include "shardplane/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ================================================================== */
/* Session: attach, plan, store, reporting                            */
/* ================================================================== */

typedef struct sp_session sp_session;

/* Collective ops, equal to the wire enum shardplane.v1.CollectiveOp. */
typedef enum sp_coll_op {
  SP_OP_ALL_GATHER = 1,
  SP_OP_REDUCE_SCATTER = 2,
  SP_OP_ALL_REDUCE = 3,
  SP_OP_BROADCAST = 4,
  SP_OP_BARRIER = 5,
} sp_coll_op;

/* The communicator a collective runs on, equal to the wire enum
 * shardplane.v1.CommKind. Each kind numbers its collectives on its own
 * (seq 1, 2, ... per kind), so a rank's fingerprints line up with those of
 * the other members of that communicator. */
typedef enum sp_comm_kind {
  SP_COMM_WORLD = 0,   /* every rank */
  SP_COMM_SHARD = 1,   /* HYBRID_SHARD: the ranks sharing r / shard_world */
  SP_COMM_REPLICA = 2, /* HYBRID_SHARD: the ranks sharing r % shard_world */
} sp_comm_kind;

typedef struct sp_session_opts {
  const char *coordinator; /* "host:port", or "unix:PATH" (a host
                            * agent's socket, shardplane agent); required */
  uint32_t rank;
  const char *device;          /* "cpu", "cuda:0"; NULL: "cpu" */
  uint64_t connect_timeout_ms; /* 0: 20000 */
  /* Deadline of each blocking call to the coordinator (GetJob, Attach,
   * store set / add, a store get that does not wait, Detach); 0: 30000. */
  uint64_t call_timeout_ms;
  /* Events the training thread may queue before the background thread has
   * sent them; 0: 65536. Rounded up to a power of two. When the queue is
   * full an event is dropped and counted (sp_session_dropped), never
   * waited for: reporting must not block training. */
  size_t queue_events;
  /* false: transitions are still checked locally but nothing is queued or
   * sent (heartbeats still are). For measuring the cost of reporting. */
  bool no_report;
  /* Events the flight recorder keeps (the last ones, kept by the
   * background thread as it drains the queue, sent when the coordinator
   * asks with FLIGHT_DUMP); 0: 2000, at most 100000 (SP_EINVAL above). */
  uint32_t flight_events;
  /* How long the session rides out a coordinator outage (its process
   * died or restarts); 0: 60000. Training goes on meanwhile (the
   * communicators need no coordinator after rendezvous); the Session
   * stream reconnects with jittered exponential backoff (50 ms doubling to
   * 2 s), reattaches with the session id, resends the rank's states and
   * reports the events it could not deliver as a gap; store calls and
   * Detach are retried (StoreAdd with a request id, so a retry is never
   * applied twice). Past the grace period the session fails with
   * SP_ETIMEDOUT naming the coordinator's address, and on_abort runs. Only
   * a coordinator with a state dir knows the session after a restart, and
   * says so at Attach: with any other, an outage ends the session at once
   * (as does a restarted coordinator that refuses the session). */
  uint64_t coordinator_grace_ms;
  /* Called once, from the background thread, when the coordinator sends
   * ABORT or the Session stream fails; reason is valid during the call. The
   * callback must be thread-safe (typically it calls sp_comm_abort). */
  void (*on_abort)(void *user, const char *reason);
  void *user;
  /* Transport and credentials, used by both of the session's connections
   * (the Session stream and the blocking calls and store). tls false:
   * cleartext HTTP/2, as the coordinator's --insecure serves. tls true:
   * TLS 1.2 or later, the coordinator's certificate checked against
   * tls_ca_file (PEM; NULL: the system trust store) and its name against
   * tls_server_name (NULL: the host part of `coordinator`); tls_cert_file
   * and tls_key_file (PEM, both or neither) present a client certificate
   * for mutual TLS. token (NULL: none) is sent as "authorization: Bearer
   * <token>" on every call; a coordinator with a token file refuses calls
   * without a valid one (UNAUTHENTICATED, which sp_session_open reports as
   * SP_EINVAL with the coordinator's message; a role that may not make a
   * call, PERMISSION_DENIED, as SP_ESTATE). All strings are copied by
   * sp_session_open; SP_EINVAL for a token that is not printable ASCII. */
  bool tls;
  const char *tls_ca_file;
  const char *tls_cert_file;
  const char *tls_key_file;
  const char *tls_server_name;
  const char *token;
} sp_session_opts;

/* Connects, fetches the job and model spec, builds the plan, checks the
 * plan version against the coordinator's, attaches as opts->rank and starts
 * the background thread. Sets SIGPIPE to SIG_IGN when the program left it
 * at its default: a write to a coordinator that died must fail, not end
 * the process. Errors: SP_EINVAL (bad opts, rank out of range),
 * SP_ETIMEDOUT (coordinator unreachable within connect_timeout_ms),
 * SP_ESTATE (plan version mismatch, naming both versions), SP_EEXIST (rank
 * already attached), SP_ENOMEM. The session owns the model, job and plan. */
int sp_session_open(const sp_session_opts *opts, sp_session **out, sp_diag *d);

/* Flushes queued events (up to timeout_ms, 0: 5000), detaches, stops the
 * background thread and frees everything. Returns the first error seen by
 * the background thread, or the flush/detach error; the session is freed
 * whatever the result. */
int sp_session_close(sp_session *s, uint64_t timeout_ms, sp_diag *d);

/* Borrowed; valid until sp_session_close. */
const sp_plan *sp_session_plan(const sp_session *s);
const sp_model *sp_session_model(const sp_session *s);
const sp_job *sp_session_job(const sp_session *s);
uint32_t sp_session_rank(const sp_session *s);
uint32_t sp_session_world(const sp_session *s);
const char *sp_session_coordinator(const sp_session *s);
/* opts.device as given ("cpu" when it was NULL). */
const char *sp_session_device(const sp_session *s);

/* Store calls on the coordinator, blocking, safe from any thread (they use
 * their own connection under a lock). get: waits until the key exists when
 * wait_ms > 0 (SP_ETIMEDOUT after it), SP_ENOENT when absent and not
 * waiting; *val is malloc'd, the caller frees it. */
int sp_session_store_set(sp_session *s, const char *key, const void *val,
                         size_t len, sp_diag *d);
int sp_session_store_get(sp_session *s, const char *key, uint64_t wait_ms,
                         uint8_t **val, size_t *len, sp_diag *d);
int sp_session_store_add(sp_session *s, const char *key, int64_t delta,
                         int64_t *value, sp_diag *d);

/* ---- where a worker is (launch.c) ----
 * Launchers tell each process who it is through the environment: torchrun
 * sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; srun sets
 * SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS (read when torchrun's are
 * not set). A program's own flags win over both. */

/* The coordinator's address, "HOST:PORT", when no flag gives it. */
#define SP_COORDINATOR_ENV "SHARDPLANE_COORDINATOR"
/* Overrides the address the Gloo backend binds and advertises to its peers
 * (sp_comm_opts.host). */
#define SP_GLOO_HOST_ENV "SHARDPLANE_GLOO_HOST"
/* The grace period of coordinator outages (sp_session_opts
 * .coordinator_grace_ms), in seconds as --coordinator-grace takes it,
 * when no flag gives it: `shardplane agent` sets it for its workers. */
#define SP_COORDINATOR_GRACE_ENV "SHARDPLANE_COORDINATOR_GRACE"
/* How often the agent (or shardplane run) has started this host's workers
 * before: 0 the first time, then one more per restart, a new incarnation
 * or a replica group's rejoining (--inject's exit faults act only at 0). */
#define SP_RESTART_ENV "SHARDPLANE_RESTART"
/* The grace period when neither says. */
#define SP_COORDINATOR_GRACE_DEFAULT_MS 60000u

/* A grace period in seconds (--coordinator-grace S or the variable above),
 * in [0.001, 604800] (a week: beyond it the job has surely ended), into
 * *ms, rounded. SP_EINVAL naming `what` (the flag, or "$VAR") and the
 * value. Any thread. */
int sp_coordinator_grace_parse(const char *what, const char *value,
                               uint64_t *ms, sp_diag *d);

typedef struct sp_launch_env {
  long rank, local_rank, world_size, local_world_size; /* -1: not set */
  const char *coordinator;       /* $SHARDPLANE_COORDINATOR; NULL: not set */
  uint64_t coordinator_grace_ms; /* $SHARDPLANE_COORDINATOR_GRACE; 0: not set */
  /* The variable each number came from (for messages); NULL: not set.
   * Static strings. */
  const char *rank_var, *local_rank_var, *world_size_var, *local_world_size_var;
} sp_launch_env;

/* Reads the variables above. SP_EINVAL, naming the variable and its value,
 * for one that is not a number in range or a rank not below the world
 * size. The strings point into the environment: valid until it changes.
 * Any thread, as long as none changes the environment. */
int sp_launch_env_read(sp_launch_env *e, sp_diag *d);

/* The address (numeric, no port) of this host's interface that a
 * connection to addr ("host:port") leaves from: the one peers on that
 * network reach this host at. Sends nothing. SP_EINVAL for an address
 * that does not resolve, SP_EIO when there is no route. Blocking only for
 * a name to resolve. */
int sp_local_addr_toward(const char *addr, char *out, size_t cap, sp_diag *d);

/* ---- reporting: training thread only ----
 * Each call costs a table check and a store into a ring (no lock, no
 * syscall). */

/* Checks the transition against the shared state tables and this rank's
 * tracker, applies it and queues it. SP_ESTATE (with the legal next states)
 * if it is illegal; nothing is queued then. unit is ignored for the root
 * machine. */
int sp_session_transition(sp_session *s, sp_machine m, uint32_t unit, int to,
                          sp_diag *d);
/* Current state in the local tracker. */
int sp_session_state(const sp_session *s, sp_machine m, uint32_t unit);
/* Queues a collective's issue: its fingerprint (op, unit, dtype, count,
 * and the communicator with this rank's group of that kind) stamped with
 * the current step and the time (CLOCK_REALTIME). The sequence number,
 * counted per communicator kind from 1, is assigned here and returned (0
 * for a NULL session or an invalid kind); pass it to
 * sp_session_collective_done when the collective returns. count is the
 * collective's count as the sp_comm_* calls and NCCL take it, elements per
 * rank: an all-gather's input (the shard), a reduce-scatter's output (the
 * reduced shard), an all-reduce's or a broadcast's whole buffer. Every
 * member of a communicator must issue the same fingerprints in the same
 * order; the coordinator compares them to name a desynchronised rank. */
uint64_t sp_session_collective(sp_session *s, sp_comm_kind comm, sp_coll_op op,
                               uint32_t unit, sp_dtype dtype, uint64_t count);
/* Queues the completion of collective `seq` of `comm` (as returned by
 * sp_session_collective), at time_us (CLOCK_REALTIME microseconds, as
 * sp_session_time_us gives; 0: now). A collective issued and never
 * completed is what a hang looks like to the coordinator, so call it only
 * once the operation has really finished on this rank. waited_us: how
 * long the training thread was blocked waiting for it (0: not at all, or
 * not measured); the coordinator takes a step less its waits as the rank's
 * own time, the measure that names a straggler. */
void sp_session_collective_done(sp_session *s, sp_comm_kind comm, uint64_t seq,
                                uint64_t time_us, uint64_t waited_us);
/* CLOCK_REALTIME in microseconds, the clock of every event. Any thread. */
uint64_t sp_session_time_us(void);
/* The trainer's progress, sent with the next message (and every later one,
 * until changed): the last loss (NaN: none) and the steps the run will
 * take in all (0: unknown). The coordinator shows them and estimates the
 * time left. */
void sp_session_set_progress(sp_session *s, double loss, uint64_t total_steps);
/* The trainer's throughput and memory, sent like the progress with the
 * next message (a heartbeat at the latest) and every later one, for the
 * coordinator's /metrics: the tokens this rank consumes per optimizer
 * step (samples, for a model without a sequence: its micro-batch times
 * the micro-batches a step); the memory it uses now and the most it used
 * (resident bytes on a CPU, allocated device bytes on a GPU), and what the
 * memory model predicted for that peak. 0: not reported (the coordinator
 * keeps the last figure it had). Any thread; a NULL session is ignored. */
void sp_session_set_throughput(sp_session *s, uint64_t tokens_per_step);
void sp_session_set_memory(sp_session *s, uint64_t in_use, uint64_t peak,
                           uint64_t predicted);
/* Switches queueing on or off (sp_session_opts.no_report) for measuring
 * what reporting costs within one run. Only between steps: SP_ESTATE unless
 * the root and every unit are IDLE. */
int sp_session_set_report(sp_session *s, bool on, sp_diag *d);
/* Sets the step number carried by later events and heartbeats. Steps are
 * numbered from 1 (0: none yet): set K before the K-th step's events, as
 * shardplane-worker does, so that after N steps the coordinator shows N,
 * the number of the worker's last "step N/N" line. */
void sp_session_set_step(sp_session *s, uint64_t step);
/* Waits until every event queued so far has been acknowledged by the
 * coordinator. SP_ETIMEDOUT after timeout_ms. Returns SP_ESTATE if the
 * coordinator rejected a transition (the first rejection in d). */
int sp_session_flush(sp_session *s, uint64_t timeout_ms, sp_diag *d);
/* Events dropped because the queue was full. Any thread. */
uint64_t sp_session_dropped(const sp_session *s);
/* Whether an ABORT arrived or the stream failed; the reason, if given,
 * receives a copy (cap bytes). Any thread. */
bool sp_session_aborted(const sp_session *s, char *reason, size_t cap);
/* Whether the ABORT named the rank at fault (SessionDown.culprit), and
 * which (*rank). The abort reason then says so: "rank C ..., not this
 * rank's fault". Any thread. */
bool sp_session_culprit(const sp_session *s, uint32_t *rank);
/* The newest replica quorum epoch the coordinator announced on the
 * stream (QUORUM; 0: none yet). The runtime adopts it at a step boundary
 * (sp_fsdp_quorum_boundary). Any thread. */
uint64_t sp_session_quorum_epoch(const sp_session *s);
/* fn is called on the session's thread when QUORUM announces a newer
 * epoch, under the session's lock (it must be quick, call no session
 * function, and be thread-safe: the runtime's aborts its replica group,
 * so a collective waiting on a dropped group fails at once, NCCL's
 * included). fn NULL unsets it; once this returns the old one is no
 * longer running. Any thread. */
void sp_session_set_quorum_hook(sp_session *s,
                                void (*fn)(void *user, uint64_t epoch),
                                void *user);
/* Flight records sent in answer to FLIGHT_DUMP so far (tests). Any
 * thread. */
uint64_t sp_session_flight_dumps(const sp_session *s);

/* ================================================================== */
/* Communicators                                                      */
/* ================================================================== */

/* A group of ranks that run collectives together. Every member calls the
 * same operations in the same order.
 *
 * Backends and buffers:
 *   - Gloo (CPU): buffers are host memory. Sums are deterministic: every
 *     member gets identical bits, summed in member order; bfloat16/float16
 *     are summed in float32 and rounded once (round to nearest even).
 *   - NCCL (GPU; only when libshardplane was built with CUDA and NCCL, which
 *     defines SHARDPLANE_HAVE_NCCL for its users): buffers are device memory
 *     on the communicator's device (opts.device "cuda:N"; managed memory
 *     also works); host pointers are
 *     refused with SP_EINVAL before anything is enqueued (a host pointer
 *     handed to NCCL would fault the GPU context). Every operation, also
 *     for a single member, goes through NCCL (or the GPU) and never touches
 *     the bytes on the host. Sums are NCCL's (ncclSum): accumulated in the
 *     wire dtype in the order of NCCL's algorithm, identical on all members
 *     but not the Gloo bits for more than one member; a single member gets
 *     its input unchanged.
 *     Each operation is enqueued on the communicator's own CUDA stream
 *     (sp_comm_cuda_stream) and the call returns once it has completed on
 *     the device, so buffers may be reused or freed right after; the call
 *     makes the communicator's device current on the calling thread. An
 *     operation that does not complete within the timeout aborts the NCCL
 *     communicator (ncclCommAbort) and returns SP_ETIMEDOUT; the
 *     communicator is then broken, like a Gloo one after a failure.
 *
 * The store a communicator bootstraps through: set and blocking get. */
typedef struct sp_comm_store {
  int (*set)(void *user, const char *key, const void *val, size_t len,
             sp_diag *d);
  /* Waits up to wait_ms for the key; *val malloc'd, caller frees. */
  int (*get)(void *user, const char *key, uint64_t wait_ms, uint8_t **val,
             size_t *len, sp_diag *d);
  /* Atomic add to an integer key (created at 0); optional, for
   * sp_comm_leave. */
  int (*add)(void *user, const char *key, int64_t delta, int64_t *value,
             sp_diag *d);
  void *user;
} sp_comm_store;

/* The session's store as an sp_comm_store (borrowing s). */
sp_comm_store sp_session_comm_store(sp_session *s);

typedef struct sp_comm sp_comm;

typedef struct sp_comm_opts {
  sp_backend backend;  /* SP_BACKEND_GLOO, or SP_BACKEND_NCCL (GPU build) */
  sp_comm_store store; /* set and get; required for more than one member */
  const char *prefix;  /* store key namespace, unique per communicator */
  uint32_t rank;       /* rank within this communicator */
  uint32_t size;       /* members */
  uint64_t timeout_ms; /* rendezvous and per-operation; 0: 60000 */
  const char *device;  /* NCCL: "cuda:N" (required); Gloo: ignored */
  /* Gloo: the numeric address this member binds and advertises; NULL:
   * $SHARDPLANE_GLOO_HOST, else 127.0.0.1 (sp_fsdp_comms_open passes the
   * interface that reaches the coordinator). NCCL: ignored. Copied. */
  const char *host;
  /* Optional, NCCL: polled (on the creating thread, every few ms) while
   * sp_comm_new waits for the other members; returning true gives up at
   * once with SP_ECANCELED. Typically it reads sp_session_aborted, so a
   * job aborted during the rendezvous does not wait out the timeout. */
  bool (*cancel)(void *user);
  void *cancel_user;
} sp_comm_opts;

/* Creates the communicator and rendezvouses with the other members (blocks
 * until all have joined or the timeout passes: SP_ETIMEDOUT). SP_EUNSUPPORTED
 * for a backend not built in.
 *
 * NCCL: checks opts.device first, before any CUDA call or store access: not
 * of the form "cuda:N" (decimal N) -> SP_EINVAL; N not below the number of
 * CUDA devices (none at all included) -> SP_ENODEV. Then it makes device N
 * current on the calling thread (cudaSetDevice, as NCCL requires), rank 0
 * creates an NCCL unique id and publishes it under "<prefix>/nccl_id" (a
 * single member publishes it only if the store has a set), the others wait
 * for it, and every member initialises its NCCL communicator non-blocking,
 * polling until it is ready, fails (SP_ENCCL), the timeout passes
 * (SP_ETIMEDOUT) or opts.cancel says stop (SP_ECANCELED); in the last two
 * cases the half-made communicator is aborted (ncclCommAbort). Each call
 * needs a fresh prefix: an id left in the store by an earlier communicator
 * would be picked up. SP_EUNSUPPORTED also when the NCCL library found at
 * run time is older than 2.14 (non-blocking init and finalize). */
int sp_comm_new(const sp_comm_opts *opts, sp_comm **out, sp_diag *d);
/* The end of a job: waits, through the store (which needs `add`), until
 * every member has called sp_comm_leave. A member that closed its
 * connections while a peer still finishes the last operation would fail
 * that operation; leaving together avoids it. Returns 0 at once for an
 * aborted or failed communicator (nothing to protect) or a single member;
 * SP_ECANCELED if sp_comm_abort is called meanwhile (it may be, from any
 * thread), SP_ETIMEDOUT after the communicator's timeout, SP_EUNSUPPORTED
 * without store `add`. */
int sp_comm_leave(sp_comm *c, sp_diag *d);
/* Closes the communicator at once. Must not run concurrently with
 * sp_comm_abort (or anything else on c). NCCL: a healthy communicator is
 * finalized (ncclCommFinalize, waited for up to the timeout, which needs
 * the other members to finalize too) and destroyed; an aborted, broken or
 * unfinalizable one is aborted (ncclCommAbort). */
void sp_comm_free(sp_comm *c);
uint32_t sp_comm_rank(const sp_comm *c);
uint32_t sp_comm_size(const sp_comm *c);
/* The CUDA stream (a cudaStream_t, as void *) every NCCL operation of c is
 * enqueued on, owned by c and valid until sp_comm_free. A runtime orders
 * communication after its compute with cudaEventRecord on the compute
 * stream and cudaStreamWaitEvent on this one (not a host synchronize). It is
 * a non-blocking stream: NOT ordered after work on the legacy default
 * stream, so data written there (cudaMemset, a kernel on stream 0, or a
 * cudaMemcpy from pageable memory, which may return before the data has
 * reached the device) needs an event or a synchronize before an operation
 * reads it.
 * Work the caller enqueues on it delays c's operations and counts against
 * their timeout. Errors: SP_EINVAL (c or stream NULL), SP_EUNSUPPORTED (not
 * an NCCL communicator; *stream = NULL). */
int sp_comm_cuda_stream(sp_comm *c, void **stream);

/* Buffers: host memory for Gloo, device memory on the communicator's device
 * for NCCL (see above). count is in elements of dt.
 *
 * recv holds size*count elements: member i's count elements at i*count.
 * send may alias recv + rank*count. */
int sp_comm_all_gather(sp_comm *c, const void *send, void *recv, size_t count,
                       sp_dtype dt, sp_diag *d);
/* send holds size*count elements; recv gets the sum over members of their
 * block `rank`. recv may alias send + rank*count. */
int sp_comm_reduce_scatter(sp_comm *c, const void *send, void *recv,
                           size_t count, sp_dtype dt, sp_diag *d);
/* In-place sum. */
int sp_comm_all_reduce(sp_comm *c, void *buf, size_t count, sp_dtype dt,
                       sp_diag *d);
int sp_comm_broadcast(sp_comm *c, void *buf, size_t count, sp_dtype dt,
                      uint32_t root, sp_diag *d);
int sp_comm_barrier(sp_comm *c, sp_diag *d);
/* Makes the operation in progress and every later one fail with
 * SP_ECANCELED, as soon as possible. Safe from any thread, also from a
 * signal-free callback such as sp_session_opts.on_abort. NCCL: only sets a
 * flag; the thread blocked in the operation sees it within a millisecond
 * and calls ncclCommAbort itself (an idle communicator is aborted by
 * sp_comm_free). */
void sp_comm_abort(sp_comm *c);

/* ================================================================== */
/* FSDP runtime: flat-parameter handles                               */
/* ================================================================== */

typedef struct sp_fsdp sp_fsdp;

/* Where the trainer is when the runtime issues a collective (for
 * sp_fsdp_opts.before_collective). */
typedef enum sp_fsdp_phase {
  SP_PHASE_OTHER = 0,    /* between steps: clipping, checkpoints, sums */
  SP_PHASE_FORWARD = 1,  /* pre_forward's unshard */
  SP_PHASE_BACKWARD = 2, /* pre_backward's unshard or prefetch, reductions */
} sp_fsdp_phase;

typedef struct sp_fsdp_opts {
  sp_session *session; /* plan, rank, reporting; required */
  /* Communicators: world (all ranks); for HYBRID_SHARD also the shard group
   * (ranks sharing r / g) and the replica group (ranks sharing r % g). The
   * runtime borrows them. NO_SHARD uses world for the all-reduce. */
  sp_comm *world, *shard_group, *replica_group;
  bool backward_prefetch;        /* BACKWARD_PRE prefetch of the next unit */
  uint32_t max_inflight_gathers; /* all-gather limiter; 0: 2 */
  /* Called once per parameter to fill the master shard before training:
   * elements [start, start + n) of parameter `param` (model index) in the
   * parameter's dtype, written to dst. */
  void (*init_param)(void *user, const sp_model *m, int32_t param,
                     int64_t start, int64_t n, void *dst);
  /* Same for buffers (whole buffer, original dtype). */
  void (*init_buffer)(void *user, const sp_model *m, int32_t buffer, void *dst);
  void *user;
  /* Fault injection (shardplane-worker --inject; tests). Called on the
   * training thread before the runtime issues each collective, with its
   * communicator, op, unit and count and the trainer's phase; NULL (the
   * default) costs one test per collective. It may block (a stall), change
   * *count or ask for the collective to be skipped: return 0 to go on, 1 to
   * skip it (all-gathers only: the unit is then unsharded with whatever
   * its buffer held, and nothing is reported, so the peers wait in a
   * collective this rank never joins), or a negative SP_E* code, which the
   * hook's caller returns. A count may only be lowered, and only for a
   * unit's reduction (the reduce-scatter, or NO_SHARD's all-reduce), which
   * then really runs with it and is reported so; any other change is
   * SP_EINVAL. inject_user is passed through. */
  int (*before_collective)(void *inject_user, sp_fsdp_phase phase,
                           sp_comm_kind comm, sp_coll_op op, uint32_t unit,
                           uint64_t *count);
  void *inject_user;
  /* Where shards, unsharded parameters, gradients and buffers live: "cpu"
   * (or NULL) in host memory; "cuda:N" in device memory of GPU N, which
   * becomes the calling thread's current device. The sharded state is
   * allocated by sp_fsdp_new, the unsharded slots by the runtime's caching
   * pool during the first step and reused by every later one (plain
   * cudaMalloc on a GPU, never freed before sp_fsdp_free; see "Memory"
   * below), and buffers are cast on the device to their compute dtype. On a
   * GPU the
   * communicators must take device pointers (the NCCL backend: see
   * sp_fsdp_comms_open), and every pointer the runtime hands out or takes
   * (views, gradients, shards, buffers, sp_fsdp_all_reduce) is device
   * memory, ordered on the runtime's compute stream (sp_fsdp_cuda_stream);
   * the init callbacks above still write host memory. Errors:
   * SP_EUNSUPPORTED (library built without CUDA), SP_ENODEV (no such GPU),
   * SP_EINVAL (not "cpu" or "cuda:N"), SP_ECUDA (file and line in d).
   * "cpu-staged", for tests: host memory that the runtime handles as a
   * device's (initialisation, checkpoints and loads staged through host
   * copies), so those paths run on a machine without a GPU. */
  const char *device;
  /* Under a replica quorum (sp_fsdp_quorum_on): the replica groups' forming
   * and operations time out after this long (0: 60000 ms). */
  uint64_t comm_timeout_ms;
} sp_fsdp_opts;

int sp_fsdp_new(const sp_fsdp_opts *opts, sp_fsdp **out, sp_diag *d);
void sp_fsdp_free(sp_fsdp *f);

/* Memory. The runtime holds a unit's sharded state (master shard, reduced
 * gradient shard, the optimizer's state) for its whole life, and its
 * unsharded storage only while a step needs it, drawn from a caching pool
 * (blocks kept and reused, never returned before sp_fsdp_free, so no step
 * after the first allocates):
 *   unsharded parameters (c * W_s elements of param_dtype): from the
 *     all-gather's issue (pre_forward, pre_backward, or a prefetch) until
 *     reshard; at most the units in use plus max_inflight_gathers
 *     all-gathers in flight;
 *   unsharded gradient (the same size): from pre_backward, which zeroes
 *     it, until its reduction is retired; reduce buffers (reduce_dtype)
 *     from post_backward likewise. A reduction is retired (its blocks back
 *     to the pool) when a unit needs a gradient slot or queues a reduction
 *     while max_inflight_gathers reductions are in flight (it waits for the
 *     oldest instead of growing), and at finish_backward.
 * What FSDP keeps unsharded, this runtime keeps too, once: with nothing to
 * shard (NO_SHARD, so any world of one rank, or HYBRID_SHARD with shard
 * groups of one, which runs as NO_SHARD) a unit's shard is its whole flat
 * parameter and is its unsharded parameter, its shard gradient the
 * unsharded gradient (FSDP's NO_SHARD flat parameter and .grad), unless
 * mixed precision needs them in another dtype: then the low-precision
 * parameters are kept from sp_fsdp_new and the gradient takes a slot as
 * above; under SHARD_GRAD_OP every unit's parameters from forward until its
 * post_backward; under FULL_SHARD and HYBRID_SHARD the root unit's from
 * root_pre_forward until post_backward(0) (it is not resharded after
 * forward). sp_fsdp_stats.mem counts every block by category (plan/
 * memory.h); sp_mem_estimate_plan predicts those counts from the plan.
 *
 * The schedule, in FSDP's order. Every call checks and reports its
 * transitions and collectives through the session. Unit 0 is the root unit
 * (it may own no parameters: its schedule still runs).
 * root_pre_forward: lazy init on the first call (buffers cast to their
 *   compute dtype), root IDLE -> FORWARD_BACKWARD, then pre_forward(0).
 * pre_forward(u): unshard u unless it still is, u -> FORWARD.
 * post_forward(u): u -> IDLE; reshard unless the strategy keeps it (the
 *   root unit, SHARD_GRAD_OP, NO_SHARD). Records the post-forward order.
 * root_post_forward: post_forward(0), root -> IDLE.
 * root_pre_backward: root -> FORWARD_BACKWARD, then pre_backward(0).
 * pre_backward(u): unshard if resharded and not prefetched,
 *   u -> BACKWARD_PRE, zero u's unsharded gradient (unless it holds
 *   gradients kept without sync, below, or is the shard gradient, which
 *   holds the step's gradient so far), then (backward_prefetch) issue
 *   the all-gather of the unit before u in post-forward order, without
 *   waiting for it.
 * post_backward(u): u -> BACKWARD_POST; queue the unit's gradient
 *   reduction (cast to reduce_dtype, pre-divide, reduce-scatter / all-reduce
 *   (HYBRID: reduce-scatter in the shard group, all-reduce in the replica
 *   group), post-divide, cast to the shard's gradient dtype and ADD to the
 *   shard gradient, which accumulates until the optimizer step or
 *   sp_fsdp_zero_grad clears it; where the unsharded gradient is the shard
 *   gradient, which already holds the earlier sum, the reduced sum
 *   replaces it); reshard. Without gradient sync
 *   (sp_fsdp_set_requires_gradient_sync) nothing is reduced: the unsharded
 *   gradient is kept for the next backward to add to.
 * finish_backward: waits for every queued reduction, every unit -> IDLE,
 *   root -> IDLE.
 * Resharding drops the unsharded views (sp_fsdp_param returns NULL) and
 * gives their storage back to the pool.
 * Collectives run in issue order on one communication thread per runtime
 * (the CPU's stand-in for a CUDA stream), so a prefetch overlaps compute.
 * The limiter keeps at most max_inflight_gathers all-gathers issued and
 * not yet complete: issuing one more first waits for the oldest. */
int sp_fsdp_root_pre_forward(sp_fsdp *f, sp_diag *d);
int sp_fsdp_pre_forward(sp_fsdp *f, uint32_t unit, sp_diag *d);
int sp_fsdp_post_forward(sp_fsdp *f, uint32_t unit, sp_diag *d);
int sp_fsdp_root_post_forward(sp_fsdp *f, sp_diag *d);
int sp_fsdp_root_pre_backward(sp_fsdp *f, sp_diag *d);
int sp_fsdp_pre_backward(sp_fsdp *f, uint32_t unit, sp_diag *d);
int sp_fsdp_post_backward(sp_fsdp *f, uint32_t unit, sp_diag *d);
int sp_fsdp_finish_backward(sp_fsdp *f, sp_diag *d);

/* A sum over every rank of the world, in place, ordered with the runtime's
 * other collectives (a model's own collective, e.g. a norm's batch mean).
 * On a GPU buf is device memory, written by work on the runtime's compute
 * stream (or already complete); the sum is complete on return. */
int sp_fsdp_all_reduce(sp_fsdp *f, void *buf, size_t count, sp_dtype dt,
                       sp_diag *d);

/* Opens the communicators a job needs through the session's store: world,
 * and for HYBRID_SHARD the shard group (ranks r with equal r / g, member
 * index r % g) and the replica group (equal r % g, member r / g); the
 * others NULL. timeout_ms 0: 60000. The backend is the job's, except that
 * a session on a GPU (sp_session_opts.device "cuda:N") gets NCCL on that
 * device. The caller frees them after the runtime. */
int sp_fsdp_comms_open(sp_session *s, uint64_t timeout_ms, sp_comm **world,
                       sp_comm **shard_group, sp_comm **replica_group,
                       sp_diag *d);

/* ---- replica groups that continue (HYBRID_SHARD) ----
 * A coordinator run with --on-group-failure continue keeps a quorum of a
 * HYBRID_SHARD job's replica groups (the groups of shard_world ranks, each
 * holding the whole model): when a rank fails, its group is dropped at a
 * step boundary and the other groups train on, their gradients averaged
 * over the groups left (the global batch shrinks by the dropped group's
 * share); the dropped group's processes start again and rejoin with the
 * live shards and optimizer state of a group that trained on, after which
 * the two are equal bit for bit. Under such a coordinator
 * sp_fsdp_comms_open opens the shard group only (world and replica group
 * NULL) and sp_fsdp_new forms the replica group itself, per quorum; the
 * world's sums (sp_fsdp_all_reduce, sp_fsdp_any, checkpoints' agreement)
 * run over the shard group and then the replica group.
 *
 * The training loop calls sp_fsdp_quorum_boundary before every step. A
 * step during which the quorum changed is discarded: sp_fsdp_optim_step
 * (or sp_fsdp_sgd_step) returns SP_EAGAIN with the gradients cleared and
 * nothing applied, and the loop runs the step again after the boundary.
 * The store keys live under "quorum/" (the coordinator's and the ranks').
 * Training thread only, like the rest of the runtime. */

/* Whether the runtime runs under such a quorum. */
bool sp_fsdp_quorum_on(const sp_fsdp *f);
/* At a step boundary: every rank of the shard group agrees whether to
 * re-form (a replica collective failed, the coordinator announced a new
 * quorum, or this process has yet to rejoin); if so, they take the newest
 * quorum from the store, form its replica group with the other groups'
 * ranks of this shard index, and a group behind (a rejoining one, or one
 * whose last step was discarded while another's committed) receives every
 * unit's shard, every registered state and the step count from the group
 * with the most steps. *next_step receives the optimizer steps taken (the
 * next step's index). One small shard-group sum when nothing changed.
 * Returns 0; 1 when the job finished (sp_fsdp_quorum_finished) while this
 * group waited to rejoin; SP_ECANCELED when the coordinator dropped this
 * rank's group (its agent restarts it); SP_ETIMEDOUT when no quorum came
 * within the communicators' timeout; the store's and backends' errors. */
int sp_fsdp_quorum_boundary(sp_fsdp *f, uint64_t *next_step, sp_diag *d);
/* The ranks training now: the world, or under a quorum shard_world times
 * the groups in it (what a sum of per-rank means divides by). */
uint32_t sp_fsdp_world_now(const sp_fsdp *f);
/* Whether every replica group is in the quorum (true without one): a
 * checkpoint needs every rank's piece. */
bool sp_fsdp_quorum_full(const sp_fsdp *f);
/* Says in the store that the job's steps are done, for groups still
 * waiting to rejoin (their boundary then returns 1). */
void sp_fsdp_quorum_finished(sp_fsdp *f, uint64_t steps);

/* A parameter's unsharded view (param_dtype of its unit) while its unit is
 * unsharded; NULL otherwise. The gradient buffer of the same shape and
 * dtype, which the trainer ADDS its gradient to during backward, before
 * post_backward(unit), as autograd accumulates into .grad: pre_backward
 * zeroes it, except without gradient sync, where it still holds the
 * earlier micro-batches' sum. It exists from pre_backward(unit) until the
 * unit's reduction is retired (NULL outside; without sync: until the
 * micro-batch that reduces it). NULL also for a parameter with
 * requires_grad false (under use_orig_params a unit may mix them): its
 * elements stay zero, reduce to zero and are left alone by the optimizer.
 * Both point into the unit's current pool block: do not keep them across
 * a reshard or a step. With nothing to shard (NO_SHARD, any world of one
 * rank) they point into the unit's master shard and shard gradient
 * themselves when those are in param_dtype (no mixed precision; for the
 * gradient, also keep_low_precision_grads), as FSDP's NO_SHARD views of
 * its flat parameter and .grad: the gradient buffer then exists always,
 * is not zeroed by pre_backward but by the optimizer step and
 * sp_fsdp_zero_grad, and holds the step's gradient so far, which the
 * trainer adds to.
 * On a GPU (sp_fsdp_opts.device) these, the buffers and the shards below
 * are device pointers. */
void *sp_fsdp_param(sp_fsdp *f, int32_t param);
void *sp_fsdp_param_grad(sp_fsdp *f, int32_t param);
sp_dtype sp_fsdp_param_dtype(const sp_fsdp *f, int32_t param);
/* A buffer's storage in its compute dtype (after the first forward) */
void *sp_fsdp_buffer(sp_fsdp *f, int32_t buffer);
sp_dtype sp_fsdp_buffer_dtype(const sp_fsdp *f, int32_t buffer);

/* The master shard of a unit (unit dtype, c elements, padding included)
 * and its reduced gradient (c elements in the unit dtype, or in
 * param_dtype with keep_low_precision_grads: sp_fsdp_shard_grad_dtype),
 * the sum of every reduction since it was last cleared; padding and
 * frozen elements hold zero. A trainer that writes a master shard itself
 * must call sp_fsdp_shards_changed before the next forward. */
void *sp_fsdp_shard(sp_fsdp *f, uint32_t unit, int64_t *numel);
void *sp_fsdp_shard_grad(sp_fsdp *f, uint32_t unit);
sp_dtype sp_fsdp_shard_grad_dtype(const sp_fsdp *f, uint32_t unit);
/* Plain SGD on every master shard: p = rne(p - lr * g) computed in double;
 * then the shard gradients are cleared, the shards marked changed
 * (sp_fsdp_shards_changed) and one optimizer step counted (the step count
 * checkpoints carry, sp_ckpt_save). Between steps only (SP_ESTATE
 * otherwise). */
int sp_fsdp_sgd_step(sp_fsdp *f, double lr, sp_diag *d);

/* "The master shards changed": a trainer that updated the shards itself
 * (its own optimizer, through sp_fsdp_shard) says so before the next
 * forward, so that no strategy serves an unsharded copy of the old values
 * (NO_SHARD, and so every world of one rank, keeps the unsharded
 * parameters across steps; a pending prefetch would hold them too): every
 * unit is resharded and gathered afresh on its next pre_forward. The
 * optimizer steps here and checkpoint loads call it themselves. Between
 * steps only (root and units IDLE): SP_ESTATE otherwise. Waits for any
 * all-gather in flight. */
int sp_fsdp_shards_changed(sp_fsdp *f, sp_diag *d);

/* ---- gradient accumulation ----
 * Two ways to train on k micro-batches per optimizer step, both equal to
 * one batch of all their samples:
 *   - with sync (the default, FSDP2's): every micro-batch's backward
 *     reduces its gradient and adds it to the sharded gradient;
 *   - without (FSDP1's no_sync(), FSDP2's set_requires_gradient_sync
 *     (False)): sp_fsdp_set_requires_gradient_sync(f, false) before the
 *     first k-1 micro-batches, whose post_backward reduces nothing and
 *     keeps the unsharded gradient (one communication per step, unsharded
 *     gradients held in memory meanwhile); true again before the last,
 *     whose post_backward reduces the sum.
 * The divide factors: every reduction divides by the world size W, so a
 * reduced gradient is the mean over ranks of the local gradients. For the
 * sum over k micro-batches to be the gradient of the whole batch's mean
 * loss, the trainer scales each micro-batch's loss (its output gradient)
 * by 1/k: with n samples per rank and micro-batch, the local loss is the
 * sum over its samples divided by n * k (the reference trainer's
 * sp_mlp_loss_over with denominator n * k). A unit whose backward runs
 * without sync must run again in the last micro-batch (with sync), or its
 * kept gradient is not reduced this step.
 * Between steps only (SP_ESTATE otherwise). */
int sp_fsdp_set_requires_gradient_sync(sp_fsdp *f, bool sync, sp_diag *d);
bool sp_fsdp_requires_gradient_sync(const sp_fsdp *f);
/* Clears every sharded gradient and every unsharded one kept without
 * sync. The optimizer steps clear the sharded ones themselves (and so the
 * unsharded ones that are the sharded gradient, NO_SHARD without mixed
 * precision). Between steps only. */
int sp_fsdp_zero_grad(sp_fsdp *f, sp_diag *d);

/* ---- gradient clipping ----
 * FSDP's clip_grad_norm_: the global 2-norm of every shard gradient of
 * every unit, *total_norm (NULL: not returned). The squares are summed in
 * float64 (each square of a float32 or 16-bit value is exact) over this
 * rank's shards in a fixed order (chunks of 4096 elements in 256 lanes,
 * then unit order), so the CPU and the GPU give the same local bits; the
 * local sums are then all-reduced over the shard group only: the world
 * for FULL_SHARD and SHARD_GRAD_OP, the shard group for HYBRID_SHARD
 * (replicas hold equal shards and must not be counted twice), and no
 * collective for NO_SHARD or shard groups of one rank (every rank has the
 * whole gradient). Padding and frozen elements hold zero and add nothing.
 * Then, as PyTorch,
 * coef = max_norm / (total_norm + 1e-6) and, when coef < 1 (total_norm
 * + 1e-6 > max_norm), every shard gradient becomes rne(g * coef)
 * (product in double). A non-finite norm is returned and nothing scaled.
 * The norm equals the unsharded gradient's within float64 rounding
 * (Gloo sums in member order; NCCL in its own, identical on every member
 * but possibly another last bit). A collective over the shard group:
 * every member calls it, between steps (SP_ESTATE otherwise); SP_EINVAL
 * unless max_norm > 0 (+inf computes the norm only). */
int sp_fsdp_clip_grad_norm(sp_fsdp *f, double max_norm, double *total_norm,
                           sp_diag *d);

/* ---- the optimizer ----
 * AdamW or SGD on the master shards, with state sharded exactly like them
 * (c float32 elements per unit per rank, zero in the padding, in the
 * runtime's storage: device memory on a GPU) and registered with the
 * runtime, so checkpoints carry it with the step count. */
typedef enum sp_optim_kind {
  SP_OPTIM_SGD = 1,   /* torch.optim.SGD: momentum, L2 weight decay */
  SP_OPTIM_ADAMW = 2, /* torch.optim.AdamW: decoupled weight decay */
} sp_optim_kind;

typedef enum sp_lr_schedule {
  SP_LR_CONSTANT = 1,
  /* linear warmup, then cosine decay to min_lr (sp_optim_lr) */
  SP_LR_COSINE = 2,
} sp_lr_schedule;

typedef struct sp_optim_opts {
  sp_optim_kind kind;
  double lr;       /* the peak learning rate; >= 0, finite */
  double momentum; /* SGD; 0: none (the buffer "momentum_buffer") */
  /* AdamW: p -= lr * weight_decay * p before the update (decoupled);
   * SGD: g += weight_decay * p (L2). Only parameters the mask decays. */
  double weight_decay;
  double beta1, beta2; /* AdamW, each in [0, 1) */
  double eps;          /* AdamW, > 0 */
  sp_lr_schedule schedule;
  uint64_t warmup_steps; /* SP_LR_COSINE */
  uint64_t total_steps;  /* SP_LR_COSINE: min_lr from this step on; > 0 */
  double min_lr;         /* SP_LR_COSINE; in [0, lr] */
  /* The weight-decay mask, per parameter by FQN: no decay where it matches
   * a no_decay pattern; else decay where it matches a decay pattern; else
   * the common GPT rule: decay for tensors of two or more dimensions
   * (weights), none for 1-D and scalar ones (biases, norm weights).
   * Patterns are fnmatch(3) globs without flags ("*" matches dots too,
   * so "*.bias" is every bias); copied by sp_fsdp_optim_init. */
  const char *const *decay;
  size_t n_decay;
  const char *const *no_decay;
  size_t n_no_decay;
} sp_optim_opts;

/* PyTorch's defaults for kind: SGD lr 1e-3, no momentum, no decay;
 * AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2; both a
 * constant schedule and the default mask. */
void sp_optim_opts_init(sp_optim_opts *o, sp_optim_kind kind);
/* SP_EINVAL naming the field, its value and what is allowed. */
int sp_optim_opts_check(const sp_optim_opts *o, sp_diag *d);
/* The learning rate of step t (0-based, optimizer steps, not
 * micro-batches): SP_LR_CONSTANT lr; SP_LR_COSINE, with w = warmup_steps
 * and T = total_steps: lr * (t + 1) / w for t < w; min_lr for t >= T;
 * else min_lr + 0.5 * (lr - min_lr) * (1 + cos(pi * (t - w) / (T - w))).
 * Computed in double. */
double sp_optim_lr(const sp_optim_opts *o, uint64_t t);
/* Whether the mask decays parameter `param` of m. */
bool sp_optim_decays(const sp_optim_opts *o, const sp_model *m, int32_t param);

/* Sets up the optimizer, once per runtime (SP_EEXIST after): checks o,
 * builds each unit's element ranges of trainable parameters in this
 * rank's shard with their decay flags (from the plan's shard params), and
 * allocates the zeroed state, registered for checkpoints: "exp_avg" and
 * "exp_avg_sq" (AdamW), "momentum_buffer" (SGD with momentum). Call it
 * before sp_ckpt_load, so a checkpoint's optimizer state and step count
 * load into it. The runtime owns the state until sp_fsdp_free. After a
 * failure (SP_EINVAL for bad options changes nothing; SP_ENOMEM may leave
 * state registered) a second call is refused with SP_ESTATE. */
int sp_fsdp_optim_init(sp_fsdp *f, const sp_optim_opts *o, sp_diag *d);
/* One optimizer step at the schedule's lr for the step count so far
 * (*lr receives it; may be NULL), on the trainable elements only, every
 * operation in double in a fixed order and rounded once to each stored
 * dtype, on the CPU and (bit for bit) on the GPU:
 *   AdamW (t = steps + 1): p -= lr * wd * p (decayed elements);
 *     m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2 (stored float32);
 *     p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps);
 *   SGD: g += wd * p (decayed); with momentum b = momentum * b + g (the
 *     first step gives b = g), g = b; p -= lr * g.
 * Then the shard gradients are cleared, the shards marked changed and the
 * step count incremented. Between steps only; SP_ESTATE before
 * sp_fsdp_optim_init. */
int sp_fsdp_optim_step(sp_fsdp *f, double *lr, sp_diag *d);
/* The learning rate the next step will use; 0 before sp_fsdp_optim_init. */
double sp_fsdp_optim_lr(const sp_fsdp *f);
/* Optimizer steps taken (sp_fsdp_optim_step and sp_fsdp_sgd_step; a
 * checkpoint load restores it). */
uint64_t sp_fsdp_optim_steps(const sp_fsdp *f);

/* Full (unpadded) value of parameter `param` in its original dtype,
 * gathered from the master shards (a collective: every rank calls it for
 * the same params in the same order). dst holds numel elements, in host
 * memory also for a runtime on a GPU. */
int sp_fsdp_gather_param(sp_fsdp *f, int32_t param, void *dst, sp_diag *d);

/* ---- device placement ---- */

/* Whether the runtime's storage is device memory (sp_fsdp_opts.device). */
bool sp_fsdp_on_device(const sp_fsdp *f);
/* The runtime's compute stream (a cudaStream_t) on a GPU, NULL on the CPU.
 * A trainer runs its kernels on it: the runtime's own device work (zeroing
 * gradients, SGD, buffer casts) runs there, and a collective queued by
 * the runtime waits for everything issued on it before. */
void *sp_fsdp_cuda_stream(const sp_fsdp *f);
/* Copies bytes between two of the runtime's tensors (views, gradients,
 * buffers), memcpy on the CPU, on the compute stream on a GPU. */
int sp_fsdp_copy(sp_fsdp *f, void *dst, const void *src, size_t bytes,
                 sp_diag *d);
/* Waits until the compute stream's work has finished (0 at once on the
 * CPU): for timing a step, or before the host reads results. */
int sp_fsdp_synchronize(sp_fsdp *f, sp_diag *d);
/* Whether the runtime's storage is plain host memory that a trainer reads
 * and writes directly ("cpu"): false on a GPU, and for "cpu-staged",
 * whose host memory the runtime reaches only through a device's paths. */
bool sp_fsdp_host_storage(const sp_fsdp *f);

/* A state tensor of the caller's, sharded exactly like the master shards,
 * that checkpoints save and load as an optimizer's state
 * ("optim.<name>.<fqn>" in FULL and SHARDED checkpoints,
 * "<unit>.optim.<name>" in LOCAL ones): a trainer with an optimizer of its
 * own registers its moments so. per_unit[u] holds, for every unit u with
 * a master shard, sp_fsdp_shard's numel elements of dtype (padding
 * included, zero there) in the runtime's storage (device memory on a
 * GPU), NULL for a unit without one; the caller keeps the storage, which
 * must outlive the runtime's use of it (until sp_fsdp_free). Names are
 * unique (SP_EEXIST), at most 8 (SP_ERANGE); SP_EINVAL for a bad name or
 * no storage. */
int sp_fsdp_register_shard_state(sp_fsdp *f, const char *name, sp_dtype dt,
                                 uint8_t **per_unit, sp_diag *d);

/* Parses a device name: "cpu" (and the test mode "cpu-staged",
 * sp_fsdp_opts.device) gives *cuda_ordinal = -1; "cuda:N" gives N
 * after checking that GPU N exists. Errors: SP_EINVAL (neither form),
 * SP_EUNSUPPORTED (library built without CUDA), SP_ENODEV ("--device
 * cuda:0: no CUDA device", or N beyond the devices present). d names the
 * device. */
int sp_device_parse(const char *device, int *cuda_ordinal, sp_diag *d);

/* Statistics for tests and benchmarks. */
typedef struct sp_fsdp_stats {
  uint64_t all_gathers;  /* issued */
  uint64_t max_inflight; /* most all-gathers in flight at once */
  uint64_t prefetches;   /* backward prefetches issued */
  uint64_t reduce_scatters;
  uint64_t all_reduces;
  /* Seconds the communication thread spent running its work since
   * sp_fsdp_new: the collectives (waiting for the peers included) and the
   * casts around them, overlapping the trainer's compute. */
  double comm_busy_s;
  /* The runtime's storage in bytes (host or device), current and peak:
   * mem.cat[SP_MEM_SHARD_PARAMS ... SP_MEM_BUFFERS] in use by category,
   * mem.total in use, mem.reserved held from the allocator (in use plus
   * the pool's cached free blocks), mem.allocs allocator calls. Not
   * counted: host staging copies of a runtime on a GPU, checkpoint files'
   * host images, the communicators' own memory. */
  sp_mem_account mem;
} sp_fsdp_stats;
void sp_fsdp_get_stats(const sp_fsdp *f, sp_fsdp_stats *out);
/* Sets every memory peak of the stats to its current value, to measure one
 * phase (a checkpoint save, a step). Training thread. */
void sp_fsdp_reset_peak_memory(sp_fsdp *f);

/* ================================================================== */
/* Checkpoints (safetensors)                                          */
/* ================================================================== */

typedef enum sp_ckpt_kind {
  SP_CKPT_FULL = 1,    /* rank 0 writes model.safetensors: every FQN */
  SP_CKPT_SHARDED = 2, /* each rank rank-R-of-W.safetensors: dim-0 chunks;
                          plus index.json */
  SP_CKPT_LOCAL = 3,   /* each rank local-R-of-W.safetensors: flat shards */
} sp_ckpt_kind;

int sp_ckpt_kind_parse(const char *s, sp_ckpt_kind *out);
const char *sp_ckpt_kind_name(sp_ckpt_kind k);
/* The folder a checkpoint directory keeps each kind in, as
 * shardplane-worker --checkpoint-dir DIR writes them: "full", "sharded",
 * "local" (DIR/full/model.safetensors, ...). */
const char *sp_ckpt_kind_dir(sp_ckpt_kind k);

/* What a directory holds: it may be one checkpoint itself
 * (model.safetensors: FULL; index.json: SHARDED; local-R-of-W.safetensors:
 * LOCAL) or hold them in its full/, sharded/ and local/ folders. */
typedef struct sp_ckpt_found {
  bool present[4];          /* by sp_ckpt_kind */
  char dir[4][4096];        /* the folder of each present kind */
  char plan_version[4][24]; /* the plan it was written with; "" unknown */
  uint64_t steps[4];        /* its step count (the optimizer steps it holds,
                              the step a load resumes after); 0 also when
                              not recorded */
} sp_ckpt_found;
/* Fills *out, reading only file headers; returns how many kinds are
 * present (0 also when dir does not exist). */
int sp_ckpt_find(const char *dir, sp_ckpt_found *out);
/* The tools' --load DIR [--load-kind K] (messages name these flags): DIR
 * itself or its full/, sharded/ or local/ folder, holding a checkpoint of
 * kind K or, when kind is 0, the only kind there. out receives the folder
 * to pass to sp_ckpt_load, *out_kind its kind. SP_ENOENT: no such
 * checkpoint there; SP_EINVAL: several kinds and kind 0. */
int sp_ckpt_resolve(const char *dir, sp_ckpt_kind kind, char *out, size_t cap,
                    sp_ckpt_kind *out_kind, sp_diag *d);
/* Before writing checkpoints of the plan `plan_version` into dir:
 * SP_EEXIST, naming dir, the plans and the --checkpoint-dir flag, when dir
 * holds a checkpoint of another plan (another configuration), which
 * writing would overwrite or mix with. 0 otherwise. */
int sp_ckpt_check_dir(const char *dir, const char *plan_version, sp_diag *d);

/* Collective: every rank calls it, between steps (root and units IDLE),
 * and returns the same result. Writes a complete checkpoint into dir or
 * leaves dir as it was:
 *   - every rank writes its files into "<dir>.tmp" (created next to dir,
 *     its parents as needed; what a crashed save left there is removed
 *     first); each file is fsync'd;
 *   - when every rank has finished, rank 0 swaps "<dir>.tmp" with dir (an
 *     atomic rename exchange; two renames on a file system without it) and
 *     removes the previous checkpoint; the directories are fsync'd.
 *   dir and "<dir>.tmp" must be one directory for all ranks (a shared file
 *   system for ranks on several machines), holding only checkpoint files:
 *   a dir holding anything else (a subdirectory) is refused, SP_EEXIST,
 *   before anything is written.
 * Content: parameters in their original dtype (full precision, the
 * master), persistent buffers in their original dtype for FULL and SHARDED
 * and in their compute dtype for LOCAL; every optimizer state registered
 * with the runtime under "optim.<state>.<fqn>" (FULL: the parameter's full
 * shape, SHARDED: its dim-0 chunks) or "<unit>.optim.<state>" (LOCAL: flat
 * shards), in the state's dtype; and the runtime's optimizer step count
 * (sp_fsdp_sgd_step counts them) with the state names in every file's
 * __metadata__ ("shardplane.optim_steps", "shardplane.optim_states",
 * comma-separated) and in SHARDED's index.json ("optim_steps",
 * "optim_states").
 * Memory: FULL and SHARDED gather one unit at a time over the shard group
 * (the master, then each state) into one host buffer of the largest unit
 * (c * W_s elements of its widest dtype; on a GPU also as much device
 * memory), and each rank writes only its own pieces from it: nothing else
 * of the model is held. LOCAL copies one shard at a time (on a GPU).
 * Errors: SP_EINVAL (dir without a name of its own, such as "/" or ".";
 * a registered state without storage for a unit), SP_EEXIST (dir holds
 * more than files), SP_EIO (naming the file),
 * SP_ENOMEM; a rank whose own part failed returns its error, the others
 * SP_ECANCELED naming that rank. A failure of the collectives themselves
 * (a peer died) returns that error. */
int sp_ckpt_save(sp_fsdp *f, sp_ckpt_kind kind, const char *dir, sp_diag *d);

typedef struct sp_ckpt_load_opts {
  /* Load parameters and buffers only: the checkpoint's optimizer states
   * and step count are not read, and the runtime's registered states and
   * step count stay as they are (fine-tuning from a checkpoint written
   * with another optimizer or none). false (the default): the checkpoint's
   * states must be exactly the registered ones, and are loaded with the
   * step count. */
  bool params_only;
} sp_ckpt_load_opts;

/* What a loaded checkpoint said about itself. */
typedef struct sp_ckpt_info {
  uint64_t optim_steps; /* its step count (0 in one written before
                           checkpoints carried it); restored into the
                           runtime unless params_only */
  uint32_t world_size;  /* of the job that wrote it (0: not recorded) */
  uint32_t n_states;    /* optimizer states it holds */
} sp_ckpt_info;

/* Loads a checkpoint into the master shards, registered optimizer states
 * and buffers, and restores the step count. Not a collective: each rank
 * reads, with pread, only the byte ranges of its own shard (and the
 * buffers) out of the files; memory is the files' headers plus, on a GPU,
 * one unit's shard staged on the host. FULL and SHARDED may come from
 * another world size and plan; LOCAL needs the same plan version. A state
 * is loaded into its registered dtype (cast from another floating dtype).
 * opts NULL: the defaults; info may be NULL. On error the runtime's shards
 * and states are partly loaded: load again or discard the runtime.
 * Errors name the file and tensor: SP_ENOENT (missing file or tensor),
 * SP_EFORMAT (shape or dtype mismatch, a bad index or metadata), SP_ESTATE
 * (LOCAL plan mismatch; a state in the checkpoint that is not registered,
 * or a registered one the checkpoint lacks, naming the state, unless
 * params_only). */
int sp_ckpt_load_with(sp_fsdp *f, sp_ckpt_kind kind, const char *dir,
                      const sp_ckpt_load_opts *opts, sp_ckpt_info *info,
                      sp_diag *d);
/* sp_ckpt_load_with(f, kind, dir, NULL, NULL, d). */
int sp_ckpt_load(sp_fsdp *f, sp_ckpt_kind kind, const char *dir, sp_diag *d);

/* Collective over the world: *any = whether any rank passed mine = true.
 * For stopping together: a rank that got a signal passes true at the next
 * step boundary, and every rank learns it at the same step, so all of them
 * checkpoint there. One all-reduce of one float (through 4 bytes of
 * device memory allocated per call on a GPU). */
int sp_fsdp_any(sp_fsdp *f, bool mine, bool *any, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
