/* What `shardplane run` asks its coordinator when the job fails, before
 * stopping it: the verdict that names the culprit (run_verdict.c). */
#ifndef SP_CLI_RUN_VERDICT_H
#define SP_CLI_RUN_VERDICT_H

#include <stdbool.h>
#include <stddef.h>

/* GetVerdict from the coordinator at addr with the admin token in
 * token_file, within timeout_ms. True, with the headline in buf, when the
 * coordinator judges the job unhealthy; false when it is healthy, has no
 * verdict, or cannot be asked (buf then ""). Prints nothing. */
bool sp_run_verdict(const char *addr, const char *token_file,
                    unsigned timeout_ms, char *buf, size_t len);

#endif
