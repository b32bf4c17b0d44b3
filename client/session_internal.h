/* Internals of the session (client/session.c) that tests and the other
 * files of libshardplane may use; not part of the public API. */
#ifndef SP_SESSION_INTERNAL_H
#define SP_SESSION_INTERNAL_H

#include <stdint.h>

#include "rpc.h"
#include "shardplane.h"

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

#endif
