#include "test_certs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "base/sp_error.h"
#include "testutil.h"

int sp_test_certs_make(const char *dir, sp_test_certs *out) {
  memset(out, 0, sizeof *out);
  if (system("openssl version >/dev/null 2>&1") != 0) return SP_EUNSUPPORTED;
  char cmd[4096];
  /* the directory comes from sp_test_mkdtemp: no quotes in it */
  if (snprintf(cmd, sizeof cmd, "sh '%s' '%s'", SP_TEST_CERTS_SCRIPT, dir) >=
      (int)sizeof cmd)
    return SP_EINVAL;
  int st = system(cmd);
  if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return SP_EIO;
  out->ca = sp_test_path(dir, "ca.pem");
  out->ca_key = sp_test_path(dir, "ca.key");
  out->server_cert = sp_test_path(dir, "server.pem");
  out->server_key = sp_test_path(dir, "server.key");
  out->client_cert = sp_test_path(dir, "client.pem");
  out->client_key = sp_test_path(dir, "client.key");
  out->other_ca = sp_test_path(dir, "other-ca.pem");
  out->other_cert = sp_test_path(dir, "other.pem");
  out->other_key = sp_test_path(dir, "other.key");
  return 0;
}

void sp_test_certs_free(sp_test_certs *c) {
  char **p[] = {&c->ca,         &c->ca_key,      &c->server_cert,
                &c->server_key, &c->client_cert, &c->client_key,
                &c->other_ca,   &c->other_cert,  &c->other_key};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) {
    free(*p[i]);
    *p[i] = NULL;
  }
}
