/* Tokens for tests: a scratch directory holding a coordinator token file
 * with one worker, one reader and one admin token, and each token in a
 * file of its own (mode 0600), as `shardplane token create` and `shardplane
 * run` leave them. Every function fails the cmocka test on error. */
#ifndef SP_AUTH_FIXTURE_H
#define SP_AUTH_FIXTURE_H

#include "server/coord_auth.h"

typedef struct sp_tauth {
  char *dir;
  char *token_file; /* the coordinator's --token-file (hashes) */
  /* indexed by role: SP_ROLE_WORKER, SP_ROLE_READER, SP_ROLE_ADMIN */
  char *file[4];                        /* a client's --token-file */
  char token[4][SP_AUTH_TOKEN_LEN + 1]; /* the tokens themselves */
} sp_tauth;

void sp_tauth_make(sp_tauth *a);
/* Removes the directory; a zeroed or freed one is a no-op. */
void sp_tauth_free(sp_tauth *a);

#endif
