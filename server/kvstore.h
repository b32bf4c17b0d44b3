/* The coordinator's key-value store, through which workers bootstrap their
 * collectives (NCCL unique id, Gloo rendezvous). Pure data structure: no
 * I/O, no threads; the coordinator drives it from its loop. Not
 * thread-safe: one thread uses a store at a time.
 *
 * Keys and values are byte strings. Every key carries a version that grows
 * by one on each change (set, add, successful compare-and-set). A key
 * created (again) starts at version 1, so after a delete the count starts
 * over; versions are per key, not a store-wide clock.
 * Waiters register for a set of keys and are woken, all in the one pass of
 * the set that completes their set, with no polling.
 * Limits are checked before anything is allocated; a call that fails
 * changed nothing.
 *
 * Errors: every function returns 0 (or 1 where said) or a negative SP_E*
 * code. Common to all: SP_EINVAL for a NULL store, a NULL or empty key, or a
 * NULL buffer with a non-zero length; SP_ETOOBIG for a key over max_key.
 * Output pointers may be NULL when the caller does not want that output.
 *
 * Callbacks run inside the store call that woke them (set, add or
 * compare-and-set), before it returns.
 */
#ifndef SP_KVSTORE_H
#define SP_KVSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sp_kvstore sp_kvstore;
typedef struct sp_kvstore_waiter sp_kvstore_waiter;

/* Called once when every key the waiter asked for exists. The waiter is
 * freed by the store right after the callback returns. The callback may
 * call any store function (set, get, wait, cancel other waiters, even ones
 * woken by the same set: they then do not run) except sp_kvstore_free.
 *
 * "Exists" means existed at some point after the wait began: a waiter
 * counts each key off as it appears, and a key deleted after it was counted
 * is not waited for again (TCPStore's WAIT has the same meaning). So when
 * the callback runs, a key may already be gone again, changed by a callback
 * that ran earlier in the same pass; look it up rather than assume. */
typedef void (*sp_kvstore_wake_fn)(void *arg);

typedef struct sp_kvstore_limits {
  size_t max_key;   /* bytes; 0: 8 KiB */
  size_t max_value; /* bytes; 0: 8 MiB */
  /* Keys that someone waits for but that do not exist yet cost a table
   * entry too, and count against max_keys and max_bytes (as keys with an
   * empty value) though not in sp_kvstore_stats.keys/bytes. */
  size_t max_keys;    /* number of keys; 0: 1,000,000 */
  size_t max_bytes;   /* keys + values in total; 0: 4 GiB */
  size_t max_waiters; /* 0: 1,000,000 */
} sp_kvstore_limits;

/* limits may be NULL (all defaults). Returns 0, SP_EINVAL (out NULL) or
 * SP_ENOMEM. */
int sp_kvstore_new(const sp_kvstore_limits *limits, sp_kvstore **out);
/* Frees the store; pending waiters are dropped without a callback (their
 * handles become invalid). NULL is a no-op. Never from a wake callback. */
void sp_kvstore_free(sp_kvstore *s);

/* Sets key to value (copied). *version gets the version this set gave the
 * key. Errors: SP_ETOOBIG (key, value, key count or total over the
 * limits), SP_EINVAL (empty key), SP_ENOMEM. Wakes the key's waiters. */
int sp_kvstore_set(sp_kvstore *s, const void *key, size_t klen,
                   const void *value, size_t vlen, uint64_t *version);

/* Like sp_kvstore_set, but the key gets `version` (non-zero) rather than the
 * next one: for reloading a store written down earlier (coord_db). Same
 * errors, plus SP_EINVAL for version 0. */
int sp_kvstore_restore(sp_kvstore *s, const void *key, size_t klen,
                       const void *value, size_t vlen, uint64_t version);

/* Looks a key up. The value pointer stays valid until the key changes or is
 * deleted; the value is followed by a NUL byte (not counted in *vlen), so
 * ASCII values can be read as C strings. SP_ENOENT when absent. */
int sp_kvstore_get(const sp_kvstore *s, const void *key, size_t klen,
                   const uint8_t **value, size_t *vlen, uint64_t *version);

/* Adds delta to the integer stored as ASCII decimal (absent: 0) and stores
 * the result the same way, as PyTorch's TCPStore does. The current value
 * must be an optional sign and one or more digits, nothing else (no
 * spaces, not empty): SP_EFORMAT otherwise. SP_ERANGE when it does not fit
 * in int64 or the sum overflows. On error the key is unchanged. Wakes the
 * key's waiters when it creates the key. */
int sp_kvstore_add(sp_kvstore *s, const void *key, size_t klen, int64_t delta,
                   int64_t *result, uint64_t *version);

/* Replaces the value only if it equals `expected` byte for byte (or, with
 * expect_absent, only if the key does not exist; `expected` is then
 * ignored). An absent key never equals `expected`, not even an empty one:
 * to create, use expect_absent. Unlike TCPStore's COMPARE_SET, *swapped says
 * whether it did. value/vlen/found/version describe the key when the call
 * returns (after any callbacks this call woke; value NULL, vlen 0 and
 * version 0 when absent). A failed comparison is not an error. SP_ETOOBIG
 * when desired, or expected without expect_absent, is over max_value. */
int sp_kvstore_compare_set(sp_kvstore *s, const void *key, size_t klen,
                           const void *expected, size_t elen,
                           bool expect_absent, const void *desired, size_t dlen,
                           bool *swapped, const uint8_t **value, size_t *vlen,
                           bool *found, uint64_t *version);

/* Removes a key; *deleted says whether it existed. Wakes nobody; waiters
 * that already counted the key keep it counted. */
int sp_kvstore_delete(sp_kvstore *s, const void *key, size_t klen,
                      bool *deleted);

/* Removes every key (a new incarnation of the job starts with none of
 * the last one's). each, when given, sees every key just before it goes
 * (the bytes are valid during the call). Waiters stay registered and keep
 * what they counted, as for sp_kvstore_delete. SP_ENOMEM (nothing removed). */
int sp_kvstore_clear(sp_kvstore *s,
                     void (*each)(void *arg, const void *key, size_t klen),
                     void *arg);

/* Waits for every key of keys[0..n) to exist (see sp_kvstore_wake_fn). If
 * they all exist already (or n is 0), returns 1, registers nothing and
 * never calls fn. Otherwise registers a waiter, returns 0 and sets *out
 * (the handle for sp_kvstore_cancel_wait; out may be NULL). Keys may repeat.
 * fn is required. Every key is checked before anything is registered:
 * SP_EINVAL (empty key), SP_ETOOBIG past max_waiters, for an oversize key,
 * for more than max_keys keys, or when the absent keys do not fit in
 * max_keys/max_bytes; SP_ENOMEM. */
int sp_kvstore_wait(sp_kvstore *s, const void *const *keys, const size_t *klens,
                    size_t n, sp_kvstore_wake_fn fn, void *arg,
                    sp_kvstore_waiter **out);
/* Cancels a waiter that has not fired; its callback will not run. Also
 * allowed from a callback for a waiter woken by the same pass and not yet
 * run. Never for a waiter whose callback has returned (it is freed). */
void sp_kvstore_cancel_wait(sp_kvstore *s, sp_kvstore_waiter *w);

typedef struct sp_kvstore_stats {
  size_t keys;    /* keys that exist */
  size_t bytes;   /* their key and value bytes */
  size_t waiters; /* registered, not yet fired or cancelled */
  uint64_t sets;  /* writes: sets, adds, successful compare-and-sets */
  uint64_t wakes; /* callbacks run */
} sp_kvstore_stats;
void sp_kvstore_get_stats(const sp_kvstore *s, sp_kvstore_stats *st);

#ifdef __cplusplus
}
#endif
#endif
