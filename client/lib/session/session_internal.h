/* Internals of the session (session.c, session_store.c, session_report.c)
 * that tests and the other files of libshardplane may use; not part of the
 * public API. */
#ifndef SP_SESSION_INTERNAL_H
#define SP_SESSION_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "base/backoff.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "lib/shardplane.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* Events per SessionUp message: ~25 bytes each on the wire, so a full
 * message stays near 100 KiB, far below any message limit. */
#define SP_SESSION_BATCH 4096u
/* SessionUp messages with events in flight (sent, not yet acknowledged):
 * bounds what a slow coordinator makes this process buffer. */
#define SP_SESSION_WINDOW 64u
/* Background drain period while events flow, and the longest one when idle
 * (the timer backs off; a flush or a half-full queue wakes it at once).
 * Every drain is a wakeup, a message and an acknowledgement that compete
 * with training for the CPU: at 1 ms a 2-rank CPU job ran 45 % slower,
 * at 50 ms about 1 %, at 100 ms within the noise (bench/step). 100 ms keeps
 * the coordinator's view well inside a heartbeat, and the default queue
 * holds 100 ms of over 600 k events a second. */
#define SP_SESSION_DRAIN_MS 100u
#define SP_SESSION_DRAIN_IDLE_MS 200u
/* queue_events bounds (after rounding up to a power of two). */
#define SP_SESSION_QUEUE_DEFAULT 65536u
#define SP_SESSION_QUEUE_MAX (1u << 24)
/* Deadline of unary calls other than waiting store gets, unless
 * sp_session_opts.call_timeout_ms says otherwise. */
#define SP_SESSION_CALL_TIMEOUT_MS 30000u
/* Store connections opened at most (callers beyond wait for one). */
#define SP_SESSION_STORE_CONNS 8u
/* Store value limit: what this library's blocking client can read back
 * (its receive limit is SP_RPC_DEFAULT_MAX_MESSAGE), less framing. */
#define SP_SESSION_STORE_MAX_VALUE (SP_RPC_DEFAULT_MAX_MESSAGE - (64u << 10))
#define SP_SESSION_STORE_MAX_KEY (8u << 10)
/* Riding out a coordinator outage: how long by default, and the backoff
 * between attempts to reach it again (doubling, jittered by +-50 %). */
#define SP_SESSION_GRACE_DEFAULT_MS SP_COORDINATOR_GRACE_DEFAULT_MS
#define SP_SESSION_BACKOFF_MIN_MS 50u
#define SP_SESSION_BACKOFF_MAX_MS 2000u

/* The delay before the next attempt (base/backoff.h, with the bounds
 * above); *base 0 at the first attempt, *state the caller's. */
static inline uint64_t sp_session_backoff(uint64_t *base, uint64_t *state) {
  return sp_backoff_next(base, SP_SESSION_BACKOFF_MIN_MS,
                         SP_SESSION_BACKOFF_MAX_MS, state);
}

/* SP_ESTATE naming both versions unless they are equal (and non-empty). */
int sp_session_check_plan_version(const char *local, const char *coordinator,
                                  sp_diag *d);

/* The SP_E* code for a gRPC status (0 for OK). */
int sp_session_rpc_error(int rpc_code);

/* The last collective seq issued on communicator kind k (tests). */
uint64_t sp_session_coll_seq(const sp_session *s, sp_comm_kind k);

/* Tests: has the background thread handle m as if the coordinator had
 * sent it (the real decode and handling), soon after the call. */
int sp_session_test_down(sp_session *s, const Shardplane__V1__SessionDown *m);
/* Tests: the last FlightRecord this session sent, decoded (free with
 * shardplane__v1__flight_record__free_unpacked), or NULL. */
Shardplane__V1__FlightRecord *sp_session_test_last_flight(sp_session *s);

/* The session id the coordinator gave at Attach (tests). */
const char *sp_session_id(const sp_session *s);

/* ---- shared by the session's files ---- */
/* SessionUp messages in flight: data batches plus heartbeats. */
#define FIFO_CAP (2 * SP_SESSION_WINDOW)
/* Spec pieces asked of GetModelSpec (the coordinator may answer less). */
#define SPEC_PIECE (1u << 20)
/* Messages the background side keeps: a gRPC status message with words
 * around it. */
#define ERRMSG_MAX (SP_RPC_STATUS_MESSAGE_MAX + 128)
/* How much of a store key goes into a message. */
#define KEY_SHOWN 64

/* Flight recorder: default and largest size (events). The largest keeps
 * a whole FlightRecord (about 40 bytes an event on the wire) well inside
 * the coordinator's 8 MiB message limit. */
#define SP_SESSION_FLIGHT_DEFAULT 2000u
#define SP_SESSION_FLIGHT_MAX 100000u
/* Communicator kinds (sp_comm_kind, CommKind on the wire). */
#define SP_SESSION_COMMS 3

/* EV_DONE carries only the communicator and the seq: the background thread
 * fills in the fingerprint from the issue it drained before, so a
 * completion costs the training thread no more than an issue. EV_STEP marks
 * where the step changes, so collectives need no step field of their own. */
enum { EV_TRANSITION = 1, EV_COLLECTIVE = 2, EV_DONE = 3, EV_STEP = 4 };

/* One queued event; 32 bytes. */
typedef struct sp_sess_event {
  uint64_t a;       /* transition, step: step; collective, done: seq */
  uint64_t count;   /* collective: elements; done: the wait, us */
  uint64_t time_us; /* CLOCK_REALTIME, microseconds */
  uint32_t unit;
  uint8_t kind;
  uint8_t x;    /* machine or op */
  uint8_t y;    /* state or dtype */
  uint8_t comm; /* collective, done: sp_comm_kind */
} sp_sess_event;

/* An event as the flight recorder keeps it: decoded, with its fingerprint
 * and step filled in. */
typedef struct sp_flight_ev {
  uint64_t seq, count, time_us, step;
  uint64_t waited_us; /* EV_DONE */
  uint32_t unit;
  uint8_t kind; /* EV_TRANSITION, EV_COLLECTIVE (issue) or EV_DONE */
  uint8_t x, y, comm;
} sp_flight_ev;

/* What the background thread remembers of an issued collective until its
 * completion comes by (a table per communicator, indexed by seq). */
typedef struct sp_issued_fp {
  uint64_t seq, count;
  uint32_t unit;
  uint8_t op, dtype;
} sp_issued_fp;

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

/* The session's copy of its transport and token options
 * (sp_session_opts.tls ... token), for both its connections
 * (session_cred.c). */
typedef struct sp_session_cred {
  bool tls;
  sp_rpc_tls_client_opts tls_opts; /* strings owned */
  char *token;                     /* owned; NULL: none */
} sp_session_cred;

int sp_session_cred_copy(sp_session_cred *c, const sp_session_opts *o,
                         sp_diag *d);
/* Points o's tls and token at c (which must outlive the client's open). */
void sp_session_cred_client_opts(const sp_session_cred *c,
                                 sp_rpc_client_opts *o);
void sp_session_cred_free(sp_session_cred *c);

struct sp_session {
  /* ---- training thread (producer) ---- */
  sp_sess_event *slots;
  uint64_t mask;       /* ring capacity - 1 */
  uint64_t head_local; /* next slot to fill */
  uint64_t tail_cache; /* the consumer's tail as last read */
  uint64_t half_check; /* head at which to look for a half-full ring */
  uint64_t dropped_local;
  uint64_t step_local;
  uint64_t coll_seq[SP_SESSION_COMMS]; /* per communicator kind */
  sp_state_tracker st;
  /* legal[m][from][to]: the shared state table as a lookup, so the check
   * on the hot path is one load */
  uint8_t legal[2][8][8];
  bool no_report;
  PAD(0);
  _Atomic uint64_t head; /* published by the producer */
  _Atomic uint64_t dropped;
  _Atomic uint64_t step;
  /* sp_session_set_progress: the loss's bits, total steps, and whether a
   * loss was given; read by the background thread for every message */
  _Atomic uint64_t loss_bits;
  _Atomic uint64_t total_steps;
  _Atomic bool has_loss;
  /* sp_session_set_throughput / sp_session_set_memory (0: not reported),
   * read likewise */
  _Atomic uint64_t tokens_per_step;
  _Atomic uint64_t mem_bytes, mem_peak_bytes, mem_predicted_bytes;
  PAD(1);
  _Atomic uint64_t tail; /* published by the consumer */
  PAD(2);

  /* ---- set by open, read-only afterwards ---- */
  sp_session_cred cred;
  uint32_t rank, world;
  uint32_t comm_index[SP_SESSION_COMMS]; /* this rank's group of each kind */
  uint32_t flight_cap;                   /* events the recorder keeps */
  char *coordinator, *device, *session_id;
  sp_model *model;
  sp_job job;
  sp_plan *plan;
  uint64_t connect_timeout_ms, call_timeout_ms;
  uint64_t grace_ms; /* coordinator outage ridden out; 0: not (the
                        coordinator has no state dir) */
  uint32_t hb_ms;
  void (*on_abort)(void *, const char *);
  void *user;
  /* sp_session_set_quorum_hook's, under lock */
  void (*on_quorum)(void *, uint64_t);
  void *quorum_user;

  /* ---- shared between threads, under lock ---- */
  uv_mutex_t lock;
  uv_cond_t cond;
  bool lock_ready;
  uint64_t acked_events;
  bool bound, stream_done;
  int first_error;
  char first_error_msg[ERRMSG_MAX];
  char abort_reason[ERRMSG_MAX];
  bool has_culprit; /* the ABORT named the rank at fault */
  uint32_t culprit;
  uint64_t rejections;
  /* a coordinator outage in progress (background side sets it): since
   * when (uv_hrtime, ns), so flush and close wait for the grace period */
  bool away;
  uint64_t away_since_ns;
  uint64_t reattaches, gap_total;
  /* store calls: the sequence of request ids (session id ":" seq) */
  _Atomic uint64_t req_seq;
  _Atomic bool aborted;
  /* the newest replica quorum the coordinator announced (QUORUM) */
  _Atomic uint64_t quorum_epoch;
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
  /* This thread's scheduling gaps (uv_hrtime, CLOCK_MONOTONIC ns): when
   * each of its timers was next due, and the most it woke up late since
   * the last message went (ms), which that message carries
   * (SessionUp.sched_gap_ms) */
  uint64_t hb_due_ns, drain_due_ns;
  uint64_t sched_gap_ms;
  Shardplane__V1__Transition *tr;
  Shardplane__V1__Transition **trp;
  Shardplane__V1__Collective *co;
  Shardplane__V1__Collective **cop;
  /* the states as of the last event drained (sent, or lost while the
   * coordinator was away): what a reattach resends */
  int32_t shadow_root;
  int32_t *shadow_units;
  uint64_t gap; /* events not delivered since the last reattach */
  /* the step as of the last event drained (EV_STEP, transitions) */
  uint64_t bg_step;
  /* issued fingerprints by comm and seq & issued_mask, for EV_DONE */
  sp_issued_fp *issued[SP_SESSION_COMMS];
  uint64_t issued_mask;
  /* the flight recorder: the last flight_cap events drained, a ring */
  sp_flight_ev *flight;
  uint64_t flight_n; /* events recorded since the start */
  /* a FLIGHT_DUMP waiting for room in the in-flight window */
  bool dump_pending;
  uint64_t dump_request;
  uint32_t dump_last_n;
  uint64_t dumps_sent;
  /* tests: a SessionDown to handle as if received (under lock), and the
   * last FlightRecord sent, packed (under lock) */
  uint8_t *test_down;
  size_t test_down_len;
  uint8_t *last_flight;
  size_t last_flight_len;
  uint64_t gap_mark; /* events up to here are delivered or in `gap` */
  uv_timer_t retry_timer, grace_timer;
  uint64_t backoff_ms, jitter;
  bool resyncing; /* the current stream began with a resync */
  bool need_bind; /* the next message is the stream's first */
  bool gave_up;   /* the grace period ran out */
};

/* One unary call on a pooled connection (session_store.c). Returns 0 with
 * *resp set (when desc is given), or the SP_E* code of the status with
 * "what: CODE: message" in d; *st (optional) gets the status either way.
 * Any thread. */
int sp_session_unary(sp_session *s, const char *what, const char *path,
                     const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *desc,
                     uint64_t timeout_ms, ProtobufCMessage **resp,
                     sp_rpc_status *st_out, sp_diag *d);
/* The connection pool's lock (open) and, once every borrowed connection is
 * back, its connections (close). */
int sp_session_pool_init(sp_session *s, sp_diag *d);
void sp_session_pool_close(sp_session *s);
/* Starts the background thread (session_report.c) with the Session stream
 * open; stops and joins it. */
int sp_session_bg_start(sp_session *s, sp_diag *d);
void sp_session_bg_stop(sp_session *s);

#endif
