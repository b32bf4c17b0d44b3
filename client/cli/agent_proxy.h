/* The agent's proxy: the gRPC calls of a host's workers, carried over one
 * HTTP/2 connection to the coordinator.
 *
 * It listens h2c on a Unix socket (unix:PATH, in a directory only this
 * user may enter; the engine also closes a connection whose peer runs
 * under another uid) and serves every method of shardplane.v1.Coordinator
 * as raw bytes: each call that comes in is started again, with the same
 * path, the caller's authorization (or the agent's token when it carries
 * none) and what is left of its deadline, as a stream on the proxy's one
 * client connection; messages go both ways as they come, the half-close
 * upstream, the status and message back, and a cancellation either way
 * cancels the other side. Nothing is decoded: the coordinator checks every
 * request as it does a direct one, and knows each rank by its Attach and
 * session id, never by the connection.
 *
 * Threads: the proxy runs its own libuv loop on a thread of its own
 * ("agent-proxy"); the functions below are called from one other thread
 * (the agent's main thread). */
#ifndef SP_CLI_AGENT_PROXY_H
#define SP_CLI_AGENT_PROXY_H

#include <stdint.h>

#include "base/sp_error.h"
#include "rpc/rpc.h"

typedef struct sp_agent_proxy sp_agent_proxy;

/* Makes a private directory (mode 0700) under $TMPDIR, else /tmp, listens
 * on a socket in it and starts the thread. upstream is the coordinator's
 * "host:port"; opts its TLS and the agent's token (copied). 0, or a
 * negative code with the reason in d. */
int sp_agent_proxy_start(const char *upstream, const sp_rpc_client_opts *opts,
                         sp_agent_proxy **out, sp_diag *d);

/* "unix:PATH": what the workers connect to (SHARDPLANE_COORDINATOR). The
 * string is the proxy's. */
const char *sp_agent_proxy_address(const sp_agent_proxy *p);

typedef struct sp_agent_proxy_stats {
  uint64_t calls;       /* calls proxied since the start */
  uint64_t local_conns; /* workers' connections accepted */
} sp_agent_proxy_stats;
/* Counters, read once the proxy stopped (so the thread wrote its last). */
void sp_agent_proxy_stats_get(const sp_agent_proxy *p, sp_agent_proxy_stats *s);

/* Stops listening, cancels the calls in flight, closes the connection,
 * joins the thread and removes the socket and its directory; the counters stay
 * readable until sp_agent_proxy_free. */
void sp_agent_proxy_stop(sp_agent_proxy *p);
void sp_agent_proxy_free(sp_agent_proxy *p);

#endif
