/* Internals of the session (session.c, session_store.c, session_report.c)
 * that tests and the other files of libshardplane may use; not part of the
 * public API. */
#ifndef SP_SESSION_INTERNAL_H
#define SP_SESSION_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane.h"
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

/* SP_ESTATE naming both versions unless they are equal (and non-empty). */
int sp_session_check_plan_version(const char *local, const char *coordinator,
                                  sp_diag *d);

/* The SP_E* code for a gRPC status (0 for OK). */
int sp_session_rpc_error(int rpc_code);

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
  sp_session_cred cred;
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
