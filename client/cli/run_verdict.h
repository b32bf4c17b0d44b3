/* What `shardplane run` asks its coordinator (run_verdict.c): the verdict
 * that names the culprit when the job fails, before stopping it, and where
 * the ranks are while it trains. Both connect afresh with the admin token
 * and print nothing. */
#ifndef SP_CLI_RUN_VERDICT_H
#define SP_CLI_RUN_VERDICT_H

#include <stdbool.h>
#include <stddef.h>

/* GetVerdict from the coordinator at addr with the admin token in
 * token_file, within timeout_ms. True, with the headline in buf, when the
 * coordinator judges the job unhealthy; false when it is healthy, has no
 * verdict, or cannot be asked (buf then ""). */
bool sp_run_verdict(const char *addr, const char *token_file,
                    unsigned timeout_ms, char *buf, size_t len);

/* The ranks in one line, from ListRanks: their steps and how many are in
 * each state (a rank's state: that of its innermost unit at work, else its
 * root's), e.g. "step 311: 3 in FORWARD, 1 in BACKWARD_PRE" or "step 40:
 * all 4 in IDLE", then the lost and not attached. False (buf "") when the
 * coordinator cannot be asked within timeout_ms. */
bool sp_run_ranks_line(const char *addr, const char *token_file,
                       unsigned timeout_ms, char *buf, size_t len);

#endif
