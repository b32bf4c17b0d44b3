/* A host's AgentSession stream to the coordinator, over which the agent
 * (or `shardplane run`) registers its node, reports its workers' deaths
 * and takes the coordinator's commands (supervise.c), and how that stream
 * outlives the coordinator's outages.
 *
 * A stream that was answered and then ends UNAVAILABLE (the coordinator
 * died or restarts, the connection was lost) while the coordinator keeps
 * the job in a state dir (AgentDown.durable) begins an outage: the stream
 * is opened again, with jittered exponential backoff (100 ms doubling to
 * 2 s) between attempts, and each attempt registers again as the same
 * node, host and pid (rejoin), with the incarnation the agent's workers
 * run and whether it stopped them; the first command that comes back ends
 * the outage. An outage longer than the grace period ends the stream for
 * good, and so does the loss of a coordinator without a state dir (a
 * restarted one would not know the job), each with a message naming the
 * coordinator's address. Any other end (a refusal) is final too.
 *
 * Threads: one, the command's main thread; each call blocks at most for the
 * wait it is given (sp_agent_ctl_open not at all). */
#ifndef SP_CLI_AGENT_CTL_H
#define SP_CLI_AGENT_CTL_H

#include <stdbool.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"

typedef struct sp_agent_ctl sp_agent_ctl;

typedef struct sp_agent_ctl_opts {
  /* The command, for messages ("shardplane WHO: ..."). */
  const char *who;
  /* What the stream connects to: the proxy's "unix:PATH", or the
   * coordinator itself. */
  const char *target;
  /* The coordinator's "host:port", for messages. */
  const char *coordinator;
  /* The connection's options (credentials when target is the
   * coordinator), read by sp_agent_ctl_open only. */
  sp_rpc_client_opts client;
  /* Outages ridden out up to this long; 0: none. */
  uint64_t grace_ms;
  uint32_t node_rank, nproc, max_restarts;
  /* elastic nodes (--nnodes MIN:MAX); 0: a fixed set of hosts */
  uint32_t min_nodes, max_nodes;
} sp_agent_ctl_opts;

/* Opens the stream and sends the registration; the coordinator's first
 * word comes from sp_agent_ctl_next (a stream that ends before it is
 * final, with no outage ridden out). The strings of o are copied. 0, or a
 * negative code with the reason in d. */
int sp_agent_ctl_open(const sp_agent_ctl_opts *o, sp_agent_ctl **out,
                      sp_diag *d);

/* Waits up to wait_ms for the next command (none at all while an outage
 * waits for its next attempt). incarnation and stopped are where the
 * agent stands, sent when it registers again. Returns 1 with *out set (the
 * caller frees it with protobuf_c_message_free_unpacked), 0 when none
 * came, or a negative code once the stream ended for good, the reason in
 * d: SP_ETIMEDOUT the coordinator stayed away past the grace period,
 * SP_EIO it was lost and keeps no state dir, SP_ENOENT it ended or refused
 * the stream (the agent may supervise on alone). Then SP_ESTATE. */
int sp_agent_ctl_next(sp_agent_ctl *c, uint64_t wait_ms, uint64_t incarnation,
                      bool stopped, Shardplane__V1__AgentDown **out,
                      sp_diag *d);

/* Sends one message up. SP_ESTATE unless the stream is up (an outage, its
 * end); the caller keeps what it could not send for after the outage. */
int sp_agent_ctl_send(sp_agent_ctl *c, const Shardplane__V1__AgentUp *up);

/* GetJob on the stream's connection (a worker's token may call it), within
 * timeout_ms: 0 with *out set (the caller frees it with
 * protobuf_c_message_free_unpacked), SP_ESTATE unless the stream is up,
 * another negative code when the call failed. */
int sp_agent_ctl_get_job(sp_agent_ctl *c, uint64_t timeout_ms,
                         Shardplane__V1__GetJobResponse **out);

/* The stream is registered and answered. */
bool sp_agent_ctl_up(const sp_agent_ctl *c);
/* An outage is being ridden out. */
bool sp_agent_ctl_away(const sp_agent_ctl *c);

/* Outages ridden out so far, and the longest, in seconds. */
void sp_agent_ctl_outages(const sp_agent_ctl *c, uint32_t *n,
                          double *longest_s);

/* Half-closes the stream, closes it and frees everything (c may be
 * NULL). */
void sp_agent_ctl_close(sp_agent_ctl *c);

/* Elastic nodes: the node rank the coordinator gave this host, said when
 * it registers again. */
void sp_agent_ctl_set_node(sp_agent_ctl *c, uint32_t node_rank);

#endif
