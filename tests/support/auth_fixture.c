#include "auth_fixture.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

void sp_tauth_make(sp_tauth *a) {
  memset(a, 0, sizeof *a);
  a->dir = sp_test_mkdtemp();
  a->token_file = sp_test_path(a->dir, "tokens");
  static const char *const names[] = {NULL, "test-worker", "test-reader",
                                      "test-admin"};
  for (int r = SP_ROLE_WORKER; r <= SP_ROLE_ADMIN; r++) {
    char file[32];
    snprintf(file, sizeof file, "%s.token", sp_auth_role_name(r));
    a->file[r] = sp_test_path(a->dir, file);
    sp_diag d = {{0}};
    if (sp_auth_token_new(a->token[r], &d) != 0 ||
        sp_auth_token_write(a->file[r], a->token[r], &d) != 0 ||
        sp_auth_file_add(a->token_file, a->token[r], r, names[r], &d) != 0)
      fail_msg("tokens: %s", d.msg);
  }
}

void sp_tauth_free(sp_tauth *a) {
  if (a->dir == NULL) return;
  sp_test_rmtree(a->dir);
  free(a->dir);
  free(a->token_file);
  for (int r = 0; r < 4; r++) free(a->file[r]);
  memset(a, 0, sizeof *a);
}
