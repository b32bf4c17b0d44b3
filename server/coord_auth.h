/* The coordinator's side of bearer tokens: the token file loaded into a
 * table, the check of every call, and the per-token store quota. Tokens,
 * roles and the file's format are auth/token.h's.
 *
 * Threads: an sp_coord_auth table is used from the coordinator's loop thread
 * only.
 * Errors: 0 or a negative SP_E* code with one line in diag naming the file
 * (and line) at fault. */
#ifndef SP_COORD_AUTH_H
#define SP_COORD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth/token.h"
#include "base/sp_error.h"
#include "rpc/rpc.h"

/* Default per-token store quota; the coordinator's --store-quota-* flags. */
#define SP_COORD_AUTH_QUOTA_BYTES (256ull << 20)
#define SP_COORD_AUTH_QUOTA_KEYS 65536ull
/* The most a token file may hold. */
#define SP_COORD_AUTH_FILE_MAX (1u << 20)

typedef struct sp_coord_auth sp_coord_auth;

typedef struct sp_coord_auth_quota {
  uint64_t bytes; /* key and value bytes a token's keys may hold; 0: default */
  uint64_t keys;  /* keys it may hold; 0: default */
} sp_coord_auth_quota;

/* Loads a token file (at most SP_COORD_AUTH_FILE_MAX bytes; refused when group
 * or others may write it). Every malformed line is an error naming "FILE:LINE";
 * so is a hash listed twice. An empty file is allowed (then every call but
 * Health is refused). q may be NULL. */
int sp_coord_auth_load(const char *path, const sp_coord_auth_quota *q,
                       sp_coord_auth **out, sp_diag *d);
void sp_coord_auth_free(sp_coord_auth *a);
size_t sp_coord_auth_count(const sp_coord_auth *a);

/* The principal whose token is `token` (the bearer value, no "Bearer "),
 * or NULL. Hashes compare in constant time and every entry is compared,
 * so the time does not depend on which entry (if any) matched. Valid while
 * a is. */
const sp_rpc_principal *sp_coord_auth_lookup(const sp_coord_auth *a,
                                             const char *token, size_t len);

/* The engine's authorize hook (sp_rpc_server_opts.authorize, arg the
 * sp_coord_auth): UNAUTHENTICATED without a valid "authorization: Bearer"
 * token, PERMISSION_DENIED naming the role and the method when the role may not
 * call it; otherwise attaches the principal. */
int sp_coord_auth_authorize(sp_rpc_call *call, void *arg, char *msg,
                            size_t cap);

/* May p write (set, add, compare-and-set, delete) key? Admins may write
 * any key; workers only keys under "comm/" (their communicators'
 * rendezvous); readers none. p NULL (no authentication) may write all.
 * Returns SP_RPC_OK or PERMISSION_DENIED with msg. */
int sp_coord_auth_store_may_write(const sp_rpc_principal *p, const char *key,
                                  char *msg, size_t cap);

/* Quota accounting. Each key belongs to the token that last created or
 * replaced it; its size is its key and value bytes.
 * check: would p writing key with a value of vlen bytes stay within p's
 * quota? SP_RPC_OK or RESOURCE_EXHAUSTED naming the quota.
 * wrote: p wrote key (value vlen bytes); deleted: key is gone.
 * All are no-ops when a or p is NULL. */
int sp_coord_auth_quota_check(sp_coord_auth *a, const sp_rpc_principal *p,
                              const char *key, size_t klen, size_t vlen,
                              char *msg, size_t cap);
int sp_coord_auth_quota_wrote(sp_coord_auth *a, const sp_rpc_principal *p,
                              const char *key, size_t klen, size_t vlen);
void sp_coord_auth_quota_deleted(sp_coord_auth *a, const char *key,
                                 size_t klen);
/* What p's keys hold now. */
void sp_coord_auth_quota_usage(const sp_coord_auth *a,
                               const sp_rpc_principal *p, uint64_t *bytes,
                               uint64_t *keys);

#endif
