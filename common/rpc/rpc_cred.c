/* The credential flags of the client programs (rpc_cred.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/flag.h"
#include "rpc_cred.h"

int sp_cred_option(sp_cred *c, int opt, const char *arg, sp_diag *d) {
  static const char *const flags[] = {"--insecure",        "--tls-ca",
                                      "--tls-cert",        "--tls-key",
                                      "--tls-server-name", "--token-file"};
  if (opt < SP_CRED_OPT_INSECURE || opt > SP_CRED_OPT_TOKEN_FILE) return 0;
  if (opt == SP_CRED_OPT_INSECURE) {
    c->insecure = true;
    return 1;
  }
  const char *flag = flags[opt - SP_CRED_OPT_INSECURE];
  int rc = sp_flag_text(
      flag, arg, opt == SP_CRED_OPT_TLS_SERVER_NAME ? "a host name" : "a file",
      d);
  if (rc != 0) return rc;
  switch (opt) {
    case SP_CRED_OPT_TLS_CA: c->tls.ca_file = arg; break;
    case SP_CRED_OPT_TLS_CERT: c->tls.cert_file = arg; break;
    case SP_CRED_OPT_TLS_KEY: c->tls.key_file = arg; break;
    case SP_CRED_OPT_TLS_SERVER_NAME: c->tls.server_name = arg; break;
    default: c->token_file = arg; break;
  }
  c->ready = false;
  return 1;
}

/* A token must be a plain header value: printable, no spaces. */
static bool token_ok(const char *t) {
  if (t[0] == '\0') return false;
  for (const char *p = t; *p; p++)
    if (*p <= 0x20 || *p >= 0x7f) return false;
  return true;
}

int sp_cred_read_token_file(const char *path, char *out, size_t cap,
                            sp_diag *d) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return sp_diag_set(d, SP_EIO, "--token-file %s: %s", path, strerror(errno));
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st) != 0)
    rc = sp_diag_set(d, SP_EIO, "--token-file %s: %s", path, strerror(errno));
  else if (!S_ISREG(st.st_mode))
    rc =
        sp_diag_set(d, SP_EFORMAT, "--token-file %s: not a regular file", path);
  else if (st.st_mode & 077)
    rc = sp_diag_set(d, SP_ESTATE,
                     "--token-file %s: mode %03o lets others read the token; "
                     "chmod 600 it",
                     path, (unsigned)(st.st_mode & 0777));
  if (rc != 0) {
    close(fd);
    return rc;
  }
  /* a token, a newline and some white space: anything longer is not one */
  char buf[SP_CRED_TOKEN_MAX + 64];
  size_t got = 0;
  while (got < sizeof buf - 1) {
    ssize_t r = read(fd, buf + got, sizeof buf - 1 - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  buf[got] = '\0';
  char *p = buf;
  while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
  size_t n = strcspn(p, "\r\n");
  while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t')) n--;
  p[n] = '\0';
  if (n == 0 || n >= cap || n > SP_CRED_TOKEN_MAX || !token_ok(p))
    rc = sp_diag_set(d, SP_EFORMAT,
                     "--token-file %s: expected a token (1-%d printable "
                     "characters) on the first line",
                     path, SP_CRED_TOKEN_MAX);
  else
    memcpy(out, p, n + 1);
  memset(buf, 0, sizeof buf);
  return rc;
}

int sp_cred_finish(sp_cred *c, sp_diag *d) {
  if (c->ready) return 0;
  const sp_rpc_tls_client_opts *t = &c->tls;
  if (c->insecure &&
      (t->ca_file || t->cert_file || t->key_file || t->server_name))
    return sp_diag_set(d, SP_EINVAL,
                       "--insecure and --tls-* exclude each other");
  if ((t->cert_file != NULL) != (t->key_file != NULL))
    return sp_diag_set(d, SP_EINVAL, "--tls-cert and --tls-key go together");
  c->has_token = false;
  if (c->token_file != NULL) {
    int rc =
        sp_cred_read_token_file(c->token_file, c->token, sizeof c->token, d);
    if (rc != 0) return rc;
    c->has_token = true;
  } else {
    const char *env = getenv(SP_TOKEN_ENV);
    if (env != NULL && env[0] != '\0') {
      if (strlen(env) > SP_CRED_TOKEN_MAX || !token_ok(env))
        return sp_diag_set(d, SP_EFORMAT,
                           "$" SP_TOKEN_ENV
                           ": expected a token (1-%d "
                           "printable characters)",
                           SP_CRED_TOKEN_MAX);
      snprintf(c->token, sizeof c->token, "%s", env);
      c->has_token = true;
    }
  }
  c->ready = true;
  return 0;
}

void sp_cred_client_opts(const sp_cred *c, sp_rpc_client_opts *o) {
  o->tls = c->insecure ? NULL : &c->tls;
  o->token = c->has_token ? c->token : NULL;
}
