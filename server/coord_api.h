/* The JSON API the dashboard polls, for scripts too (coord_api.c;
 * docs/dashboard-api.md describes every route and field):
 *
 *   /api/v1/job      the job's state, progress, throughput, ranks by
 *                    status and state, alerts and the verdict in words
 *   /api/v1/ranks    every rank's figures as columns (the heat map),
 *                    ?first=N&count=M
 *   /api/v1/history  the time series of coord_history.h, ?since=T_MS
 *   /api/v1/plan     the units and the sharding
 *   /api/v1/buffers  the buffer table by FQN, ?first=&count=&prefix=
 *
 * A GET of one of them fills the listener's answer: 200 and the JSON; 404
 * (JSON: the error and the routes there are) for another path; 400 (JSON:
 * the error and the argument at fault) for an unknown or repeated
 * argument or a bad value. Query values are untrusted: numbers are
 * decimal digits only, bounded; strings are bounded, and whatever they
 * echo is escaped. Every string in an answer is valid UTF-8 (a byte that
 * is not, in a host name a rank sent, becomes U+FFFD) with <, > and &
 * escaped, so that no answer can be read as markup.
 *
 * Threads: the loop thread only, like every reader of the coordinator. */
#ifndef SP_COORD_API_H
#define SP_COORD_API_H

#include "coord_http.h"
#include "coordinator.h"

/* The most an answer may hold (a page of ranks over it is refused with
 * 400 naming count: ask for fewer). */
#define SP_COORD_API_MAX_BODY (256u << 20)
/* Ranks listed by number in an alert's or the verdict's culprits and
 * victims (the counts and the ranges in words are complete). */
#define SP_COORD_API_MAX_LISTED 1000u
/* Buffers in one page of /api/v1/buffers at most. */
#define SP_COORD_API_BUFFER_PAGE 1000u

/* Answers GET path (e.g. "/api/v1/job") with query q (NULL: none) in r,
 * its body malloc'd for the listener to free. Returns 0, or SP_ENOMEM
 * with r left empty (no body). */
int sp_coord_api_get(struct sp_coord *c, const char *path,
                     const sp_coord_http_query *q, sp_coord_http_resp *r);

#endif
