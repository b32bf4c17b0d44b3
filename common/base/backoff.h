/* Jittered exponential backoff between attempts to reach a peer again,
 * shared by the library's session (its coordinator's outages) and the
 * agent's stream to the coordinator. No lock, no global state: each
 * caller keeps its own base and random state, on one thread. */
#ifndef SP_BACKOFF_H
#define SP_BACKOFF_H

#include <stdint.h>

/* Advances *base (0: the first attempt) from min_ms, doubling up to
 * max_ms, and returns the delay before the next attempt: the base
 * jittered by +-50 %. *state is the caller's random state (any value to
 * start, 0 included). */
uint64_t sp_backoff_next(uint64_t *base, uint64_t min_ms, uint64_t max_ms,
                         uint64_t *state);

#endif
