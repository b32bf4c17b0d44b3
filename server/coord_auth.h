/* Bearer tokens with roles: the token file, the coordinator's check of
 * every call, the per-token store quota, and the making of new tokens
 * (`shardplane token create`, `shardplane run`). docs/security.md has the
 * roles, the methods each may call and the file format.
 *
 * A token is 256 random bits shown as "spt_" and 43 base64url characters.
 * The token file holds only SHA-256 hashes of tokens, one line each:
 *
 *     sha256:<64 lower-case hex> <role> <name>
 *
 * role is worker, reader or admin; name is 1-64 of [A-Za-z0-9._-]; blank
 * lines and lines starting with '#' are ignored.
 *
 * Threads: an sp_auth table is used from the coordinator's loop thread
 * only; the token functions are safe from any thread.
 * Errors: 0 or a negative SP_E* code with one line in diag naming the file
 * (and line) at fault. */
#ifndef SP_COORD_AUTH_H
#define SP_COORD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "rpc/rpc.h"

/* Roles, in sp_rpc_principal.role. */
enum { SP_ROLE_WORKER = 1, SP_ROLE_READER = 2, SP_ROLE_ADMIN = 3 };

/* "worker", "reader", "admin"; "?" for anything else. */
const char *sp_auth_role_name(int role);
/* The role named s, or 0 when s names none. */
int sp_auth_role_parse(const char *s);

#define SP_AUTH_TOKEN_PREFIX "spt_"
/* A token's length: the prefix and 43 base64url characters (32 bytes). */
#define SP_AUTH_TOKEN_LEN 47
#define SP_AUTH_NAME_MAX 64
/* Default per-token store quota; the coordinator's --store-quota-* flags. */
#define SP_AUTH_QUOTA_BYTES (256ull << 20)
#define SP_AUTH_QUOTA_KEYS 65536ull
/* The most a token file may hold. */
#define SP_AUTH_FILE_MAX (1u << 20)

/* A fresh token (NUL-terminated) into out[SP_AUTH_TOKEN_LEN + 1], from
 * OpenSSL's RAND_bytes. SP_EIO when it has no entropy. */
int sp_auth_token_new(char out[SP_AUTH_TOKEN_LEN + 1], sp_diag *d);

/* Appends "sha256:<hash of token> <role> <name>\n" to the token file at
 * path, creating it with mode 0600. Refuses (SP_ESTATE) a file that is not
 * a regular file or that group or others may read or write: a token file
 * others can change could grant them admin. SP_EINVAL for a bad role or
 * name. */
int sp_auth_file_add(const char *path, const char *token, int role,
                     const char *name, sp_diag *d);

/* Writes token and a newline to a new file at path, mode 0600 (SP_EEXIST
 * when it exists): the form `--token-file` reads. */
int sp_auth_token_write(const char *path, const char *token, sp_diag *d);

typedef struct sp_auth sp_auth;

typedef struct sp_auth_quota {
  uint64_t bytes; /* key and value bytes a token's keys may hold; 0: default */
  uint64_t keys;  /* keys it may hold; 0: default */
} sp_auth_quota;

/* Loads a token file (at most SP_AUTH_FILE_MAX bytes; refused when group or
 * others may write it). Every malformed line is an error naming
 * "FILE:LINE"; so is a hash listed twice. An empty file is allowed (then
 * every call but Health is refused). q may be NULL. */
int sp_auth_load(const char *path, const sp_auth_quota *q, sp_auth **out,
                 sp_diag *d);
void sp_auth_free(sp_auth *a);
size_t sp_auth_count(const sp_auth *a);

/* The principal whose token is `token` (the bearer value, no "Bearer "),
 * or NULL. Hashes compare in constant time and every entry is compared,
 * so the time does not depend on which entry (if any) matched. Valid while
 * a is. */
const sp_rpc_principal *sp_auth_lookup(const sp_auth *a, const char *token,
                                       size_t len);

/* The engine's authorize hook (sp_rpc_server_opts.authorize, arg the
 * sp_auth): UNAUTHENTICATED without a valid "authorization: Bearer" token,
 * PERMISSION_DENIED naming the role and the method when the role may not
 * call it; otherwise attaches the principal. */
int sp_auth_authorize(sp_rpc_call *call, void *arg, char *msg, size_t cap);

/* May p write (set, add, compare-and-set, delete) key? Admins may write
 * any key; workers only keys under "comm/" (their communicators'
 * rendezvous); readers none. p NULL (no authentication) may write all.
 * Returns SP_RPC_OK or PERMISSION_DENIED with msg. */
int sp_auth_store_may_write(const sp_rpc_principal *p, const char *key,
                            char *msg, size_t cap);

/* Quota accounting. Each key belongs to the token that last created or
 * replaced it; its size is its key and value bytes.
 * check: would p writing key with a value of vlen bytes stay within p's
 * quota? SP_RPC_OK or RESOURCE_EXHAUSTED naming the quota.
 * wrote: p wrote key (value vlen bytes); deleted: key is gone.
 * All are no-ops when a or p is NULL. */
int sp_auth_quota_check(sp_auth *a, const sp_rpc_principal *p, const char *key,
                        size_t klen, size_t vlen, char *msg, size_t cap);
int sp_auth_quota_wrote(sp_auth *a, const sp_rpc_principal *p, const char *key,
                        size_t klen, size_t vlen);
void sp_auth_quota_deleted(sp_auth *a, const char *key, size_t klen);
/* What p's keys hold now. */
void sp_auth_quota_usage(const sp_auth *a, const sp_rpc_principal *p,
                         uint64_t *bytes, uint64_t *keys);

#endif
