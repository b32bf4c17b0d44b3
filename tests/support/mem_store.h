/* An in-memory store for communicator tests: a key/value list under a
 * mutex, with a condition variable (CLOCK_MONOTONIC) so a get waits for a
 * key up to its wait_ms; thread-safe, so member threads of one process can
 * bootstrap through it. It does not cross fork(). */
#ifndef SP_MEM_STORE_H
#define SP_MEM_STORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/shardplane.h"

typedef struct sp_mstore_entry sp_mstore_entry;

typedef struct sp_mstore {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC */
  sp_mstore_entry *head;
  int fail_set;        /* nonzero: every set fails with this code */
  unsigned sets, gets; /* calls so far (read them when no call runs) */
} sp_mstore;

void sp_mstore_init(sp_mstore *s);
void sp_mstore_destroy(sp_mstore *s);

/* sp_comm_store's set and get (user: the sp_mstore). A get with wait_ms 0
 * answers SP_ENOENT at once for a missing key; otherwise SP_ETIMEDOUT once
 * wait_ms passed without it. */
int sp_mstore_set(void *user, const char *key, const void *val, size_t len,
                  sp_diag *d);
int sp_mstore_get(void *user, const char *key, uint64_t wait_ms, uint8_t **val,
                  size_t *len, sp_diag *d);

/* The store as a communicator's (set and get; no add). */
sp_comm_store sp_mstore_comm_store(sp_mstore *s);

/* Length of a key's value, or -1 when absent. */
long sp_mstore_len(sp_mstore *s, const char *key);

#endif
