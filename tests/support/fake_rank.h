/* Fake ranks against an in-process coordinator (coord_fixture.h): each
 * one is an Attach and a Session stream on a connection of its own,
 * driven with SessionUp messages the test builds, so that the test
 * chooses every event, figure and silence the coordinator sees.
 *
 * Failures (an Attach refused, a send that fails, an ack that does not
 * come) fail the test through cmocka. A fake rank is not thread-safe:
 * one thread at a time may use it. Its failures longjmp, which cmocka
 * supports on the test's own thread only. */
#ifndef SP_TEST_FAKE_RANK_H
#define SP_TEST_FAKE_RANK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_fixture.h"
#include "server/coordinator.h"

/* Room for the plan version GetJob reports and every Attach must name. */
#define SP_FAKE_VERSION_MAX 32

typedef struct sp_fake_rank {
  sp_rpc_sync *cli;      /* its own connection; owned, NULL when closed */
  sp_rpc_sync_stream *s; /* its Session stream; owned, NULL when closed */
  char session[64];      /* the session id Attach gave */
  uint32_t rank;
  uint64_t seq; /* of the last SessionUp sent */
  /* What came down the stream while sp_fake_rank_send_up waited for an
   * ack or sp_fake_rank_drain read: the first ABORT, and the last
   * FLIGHT_DUMP (dump_asked stays set until the caller clears it), and
   * whether a FLIGHT_DUMP came after the ABORT (a worker may be gone by
   * then). */
  bool aborted, has_culprit, dump_after_abort;
  uint32_t culprit;
  char reason[SP_DIAG_MAX];
  bool dump_asked;
  uint64_t dump_id;
  uint32_t dump_last_n;
} sp_fake_rank;

/* Starts fx's coordinator for model with job flags ("name", "value"
 * pairs, NULL-terminated; sp_coord_fixture_start with the default
 * heartbeat timeout) and copies the plan version into version (cap
 * bytes, SP_FAKE_VERSION_MAX will do). With got non-NULL, *got is the
 * GetJob response that told it, the caller's to free (sp_test_free_msg).
 * Stop it with sp_coord_fixture_stop once its fake ranks are closed. */
void sp_fake_job_start(sp_coord_fixture *fx, const char *model,
                       const char *const *flags, char *version, size_t cap,
                       Shardplane__V1__GetJobResponse **got);

/* Resets f, attaches it to fx's coordinator as rank of world_size on
 * host (pid 1000 + rank, device "cpu", plan_version as GetJob told) and
 * opens its Session stream on a connection of its own. Whatever f held
 * before is forgotten, not closed. */
void sp_fake_rank_attach(sp_fake_rank *f, sp_coord_fixture *fx,
                         const char *plan_version, uint32_t rank,
                         uint32_t world_size, const char *host);

/* Sends up as f (its rank, session and next seq filled in) and waits up
 * to 5 s for its ack: the coordinator has taken the message in when this
 * returns. up stays the caller's. */
void sp_fake_rank_send_up(sp_fake_rank *f, Shardplane__V1__SessionUp *up);

/* Sends up as f (NULL: an otherwise empty SessionUp) at step, carrying
 * one transition: machine's unit (Shardplane__V1__Machine, unit 0 for
 * the root) entered state at time_us on the rank's clock. up's step is
 * set; its transitions are the caller's again (none) on return. */
void sp_fake_rank_transition(sp_fake_rank *f, int machine, uint32_t unit,
                             int state, uint64_t step, uint64_t time_us,
                             Shardplane__V1__SessionUp *up);

/* Reads what comes down f's stream within wait_ms (at least 1 ms: 0
 * would wait for ever), then whatever is already there. */
void sp_fake_rank_drain(sp_fake_rank *f, uint64_t wait_ms);

/* Closes f's stream and connection (either may be NULL already) and sets
 * both NULL: the coordinator sees the rank's stream end. */
void sp_fake_rank_close(sp_fake_rank *f);

#endif
