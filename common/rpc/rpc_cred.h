/* The credential flags every client program takes (shardplane-worker, the
 * remote `shardplane` commands, `shardplane run`), parsed one way:
 *
 *   --insecure              cleartext HTTP/2 (otherwise TLS)
 *   --tls-ca FILE           CA bundle for the server's certificate
 *                           (otherwise the system trust store)
 *   --tls-cert FILE         client certificate, for mutual TLS
 *   --tls-key FILE          its private key
 *   --tls-server-name NAME  the name the server's certificate must carry
 *   --token-file FILE       a file holding the bearer token
 *
 * Without --token-file the token comes from $SHARDPLANE_TOKEN (flags win);
 * without either, calls carry none. A token file must be readable by its
 * owner only.
 *
 * Threads: none of its own; a sp_cred is used by one thread. Strings from
 * the command line are borrowed (argv outlives the program's use of them);
 * the token is copied into the struct. */
#ifndef SP_RPC_CRED_H
#define SP_RPC_CRED_H

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

#include "base/sp_error.h"
#include "rpc/rpc.h"

#define SP_TOKEN_ENV "SHARDPLANE_TOKEN"
/* A token is at most this long (the engine's header limit). */
#define SP_CRED_TOKEN_MAX 1024

/* getopt_long codes of the credential flags. */
enum {
  SP_CRED_OPT_INSECURE = 0x5c00,
  SP_CRED_OPT_TLS_CA,
  SP_CRED_OPT_TLS_CERT,
  SP_CRED_OPT_TLS_KEY,
  SP_CRED_OPT_TLS_SERVER_NAME,
  SP_CRED_OPT_TOKEN_FILE,
};

/* Entries for a getopt_long table (comma-separated, no trailing comma). */
#define SP_CRED_OPTIONS                                            \
  {"insecure", no_argument, NULL, SP_CRED_OPT_INSECURE},           \
      {"tls-ca", required_argument, NULL, SP_CRED_OPT_TLS_CA},     \
      {"tls-cert", required_argument, NULL, SP_CRED_OPT_TLS_CERT}, \
      {"tls-key", required_argument, NULL, SP_CRED_OPT_TLS_KEY},   \
      {"tls-server-name", required_argument, NULL,                 \
       SP_CRED_OPT_TLS_SERVER_NAME},                               \
  {                                                                \
    "token-file", required_argument, NULL, SP_CRED_OPT_TOKEN_FILE  \
  }
#define SP_CRED_N_OPTIONS 6

#define SP_CRED_OPTIONS_HELP                                                    \
  "  --insecure                   cleartext HTTP/2 (default: TLS)\n"            \
  "  --tls-ca FILE                CA bundle the coordinator's certificate\n"    \
  "                               must chain to (default: system store)\n"      \
  "  --tls-cert FILE              client certificate for mutual TLS\n"          \
  "  --tls-key FILE               its private key\n"                            \
  "  --tls-server-name NAME       name the certificate must carry (default:\n"  \
  "                               the coordinator's host)\n"                    \
  "  --token-file FILE            bearer token, in a file only its owner may\n" \
  "                               read (default: the token itself in\n"         \
  "                               $" SP_TOKEN_ENV ")\n"

typedef struct sp_cred {
  bool insecure;
  sp_rpc_tls_client_opts tls; /* borrowed strings */
  const char *token_file;     /* borrowed */
  bool ready;                 /* sp_cred_finish ran */
  bool has_token;
  char token[SP_CRED_TOKEN_MAX + 1];
} sp_cred;

/* Records one credential flag. Returns 1 when opt was one (0 when it was
 * not, so the caller goes on with its own flags), or SP_EINVAL with the
 * message (naming the flag and value) in d. */
int sp_cred_option(sp_cred *c, int opt, const char *arg, sp_diag *d);

/* After parsing: checks the flags hold together (--insecure with --tls-*,
 * --tls-key without --tls-cert: SP_EINVAL, bad usage) and reads the token
 * from --token-file or $SHARDPLANE_TOKEN (SP_EIO, SP_ESTATE for a file
 * group or others may read, SP_EFORMAT for an empty or unprintable
 * token; d names the file or variable). Idempotent. */
int sp_cred_finish(sp_cred *c, sp_diag *d);

/* Fills o->tls (NULL with --insecure) and o->token (NULL without one) from
 * a finished c; the pointers borrow from c. */
void sp_cred_client_opts(const sp_cred *c, sp_rpc_client_opts *o);

/* Reads a token from a file that only its owner may read: the first line,
 * surrounding white space removed. */
int sp_cred_read_token_file(const char *path, char *out, size_t cap,
                            sp_diag *d);

#endif
