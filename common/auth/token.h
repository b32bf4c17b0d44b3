/* Bearer tokens with roles, and the token file that lists them: what
 * the coordinator checks (server/coord_auth.h) and what `shardplane token
 * create` and `shardplane run` make, in one place, so that the CLI need
 * not link the coordinator. docs/security.md has the roles, the methods
 * each may call and the file format.
 *
 * A token is 256 random bits shown as "spt_" and 43 base64url characters.
 * The token file holds only SHA-256 hashes of tokens, one line each:
 *
 *     sha256:<64 lower-case hex> <role> <name>
 *
 * role is worker, reader or admin; name is 1-64 of [A-Za-z0-9._-]; blank
 * lines and lines starting with '#' are ignored.
 *
 * Threads: every function is safe from any thread.
 * Errors: 0 or a negative SP_E* code with one line in diag naming the file
 * at fault. */
#ifndef SP_AUTH_TOKEN_H
#define SP_AUTH_TOKEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"

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

/* A fresh token (NUL-terminated) into out[SP_AUTH_TOKEN_LEN + 1], from
 * OpenSSL's RAND_bytes. SP_EIO when it has no entropy. */
int sp_auth_token_new(char out[SP_AUTH_TOKEN_LEN + 1], sp_diag *d);

/* SHA-256 of the token's len bytes into h, as the token file holds it.
 * SP_EIO when OpenSSL fails (d may be NULL). */
int sp_auth_token_hash(const char *token, size_t len, uint8_t h[32],
                       sp_diag *d);

/* Whether s is a token's name: 1-SP_AUTH_NAME_MAX of [A-Za-z0-9._-]. */
bool sp_auth_name_valid(const char *s);

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

#endif
