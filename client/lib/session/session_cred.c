/* The session's transport and token options, copied once at open and
 * handed to both of its connections (session_report.c, session_store.c). */
#include <stdlib.h>
#include <string.h>

#include "base/strmap.h"
#include "session_internal.h"

static int dup_opt(const char *src, const char **dst) {
  *dst = NULL;
  if (src == NULL) return 0;
  char *s = sp_strdup(src);
  if (s == NULL) return SP_ENOMEM;
  *dst = s;
  return 0;
}

int sp_session_cred_copy(sp_session_cred *c, const sp_session_opts *o,
                         sp_diag *d) {
  memset(c, 0, sizeof *c);
  if (o->token != NULL) {
    size_t n = strnlen(o->token, 1025);
    bool ok = n > 0 && n <= 1024;
    for (size_t i = 0; ok && i < n; i++)
      ok = o->token[i] > 0x20 && o->token[i] < 0x7f;
    if (!ok)
      return sp_diag_set(d, SP_EINVAL,
                         "session: the token must be 1-1024 "
                         "printable characters without spaces");
  }
  c->tls = o->tls;
  int rc = 0;
  if (o->tls) {
    rc = dup_opt(o->tls_ca_file, &c->tls_opts.ca_file);
    if (rc == 0) rc = dup_opt(o->tls_cert_file, &c->tls_opts.cert_file);
    if (rc == 0) rc = dup_opt(o->tls_key_file, &c->tls_opts.key_file);
    if (rc == 0) rc = dup_opt(o->tls_server_name, &c->tls_opts.server_name);
  }
  if (rc == 0 && o->token != NULL && (c->token = sp_strdup(o->token)) == NULL)
    rc = SP_ENOMEM;
  if (rc != 0) {
    sp_session_cred_free(c);
    return sp_diag_set(d, rc, "out of memory");
  }
  return 0;
}

void sp_session_cred_client_opts(const sp_session_cred *c,
                                 sp_rpc_client_opts *o) {
  o->tls = c->tls ? &c->tls_opts : NULL;
  o->token = c->token;
}

void sp_session_cred_free(sp_session_cred *c) {
  free((char *)c->tls_opts.ca_file);
  free((char *)c->tls_opts.cert_file);
  free((char *)c->tls_opts.key_file);
  free((char *)c->tls_opts.server_name);
  if (c->token != NULL) {
    memset(c->token, 0, strlen(c->token));
    free(c->token);
  }
  memset(c, 0, sizeof *c);
}
