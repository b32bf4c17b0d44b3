/* Replica groups that continue: the coordinator's per-step quorum of a
 * HYBRID_SHARD job's replica groups (--on-group-failure continue).
 *
 * When a rank of group G dies, is lost or its node goes, G (and every
 * group sharing a host with it: its agent restarts all of its workers) is
 * dropped: a new epoch without it goes into the store ("quorum/epoch",
 * "quorum/e/<E>", and G's generation "quorum/gen/<G>", under keys no
 * worker token may write) and down every Session stream (QUORUM), and
 * the agents of its hosts are told AGENT_RESTART. The ranks of the other
 * groups adopt the epoch at their next step boundary (fsdp_quorum.c) and
 * train on. The restarted processes say they are ready
 * ("comm/quorum/ready/<G>/<gen>/<rank>"); once every rank of G is, an
 * epoch with G follows, and at the boundary G receives the live state.
 * A rank's plea for the same groups again ("comm/quorum/reform/<E>": its
 * replica group broke and nobody was lost) gives the next epoch too.
 *
 * The quorum lives in the store, which a state dir keeps: a restarted
 * coordinator reads it back. A death that would leave no group, or a job
 * without the policy, goes the way of every death (coord_agents.c).
 * Everything runs on the coordinator's loop. */
#ifndef SP_COORD_QUORUM_H
#define SP_COORD_QUORUM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* After the state dir was read: the quorum read back from the store, or
 * epoch 0 of every group written into it. SP_ENOMEM. */
int sp_coord_quorum_init(sp_coord *c);
void sp_coord_quorum_free(sp_coord *c);
/* A new incarnation emptied the store: epoch 0 of every group again. */
void sp_coord_quorum_reset(sp_coord *c);
/* Whether the job's replica groups continue through faults. */
bool sp_coord_quorum_on(const sp_coord *c);
/* How telling a cause is: a rank's stream broke, its node's agent went
 * (the whole host or its Slurm step: no agent reports its workers), an
 * agent's word on an exit status, or on a signal; or the hang diagnosis's
 * stall verdict, which says where the rank stopped (its process is
 * killed after it, by its agent: the signal is the agent's, not the
 * fault). */
enum {
  SP_COORD_CAUSE_SEEN = 0,
  SP_COORD_CAUSE_NODE = 1,
  SP_COORD_CAUSE_STATUS = 2,
  SP_COORD_CAUSE_SIGNAL = 3,
  SP_COORD_CAUSE_STALL = 4
};
/* A fault of `rank` (why: what happened, for the log and the events):
 * true when the quorum takes it (its group is dropped now, or was
 * already), false when it is the job's to end or restart. A more telling
 * cause (SP_COORD_CAUSE_*) of a rank of a group dropped within the last
 * 5 s replaces the one recorded: the rank's stream usually breaks before
 * its agent reaps it, and a neighbour that failed after it exits with a
 * status, while the rank that was killed has a signal. */
bool sp_coord_quorum_drop(sp_coord *c, uint32_t rank, const char *why,
                          int cause);
/* Whether rank's group is out of the quorum, or back in it and not yet
 * past the step it rejoined at: its ranks wait for the others (to be let
 * in, and for the live state) for as long as the others' step takes, so
 * a stall is not judged by their silence, and one they cause is not
 * theirs to be dropped for (coord_stall.c, coord_verdict.c). */
bool sp_coord_quorum_settling(const sp_coord *c, uint32_t rank);
/* A key a worker wrote (coord_store.c): readiness and pleas are acted
 * on; any other key is ignored. */
void sp_coord_quorum_key(sp_coord *c, const char *key, size_t klen);

/* Whether the job is done under the quorum: every rank of the groups in
 * it detached (after its last step), and no rank of a group out of it is
 * attached (one still waiting to rejoin ends by itself then). false
 * without a quorum. */
bool sp_coord_quorum_finished(const sp_coord *c);
/* The quorum for the operator views (GetJob, GetVerdict and
 * ListIncarnations: shardplane status, why, incarnations): NULL without
 * one, or out of memory; else one block the caller frees with free()
 * (the messages and their summaries are in it; `why` points into the
 * quorum, valid until it next changes). */
Shardplane__V1__ReplicaQuorum *sp_coord_quorum_report(const sp_coord *c);

#endif
