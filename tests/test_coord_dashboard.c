/* The dashboard's embedded assets (server/coord_dashboard.h): each path
 * served with its type, as the bytes of its file in server/dashboard/;
 * "/" is the page; anything else is not an asset. And what the page
 * promises that a look at its text can check: no innerHTML (data from the
 * API is set as text), nothing fetched from another site. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/coord_dashboard.h"
#include "support/testutil.h"

#define DASHBOARD_DIR SP_TEST_DATA "/../../server/dashboard"

/* A file's bytes (malloc'd, NUL-terminated), or a failed test. */
static char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) fail_msg("cannot open %s", path);
  char *buf = NULL;
  size_t n = 0, cap = 0;
  for (;;) {
    if (n + 4096 + 1 > cap) {
      cap = cap ? cap * 2 : 65536;
      char *p = realloc(buf, cap);
      assert_non_null(p);
      buf = p;
    }
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
  }
  fclose(f);
  buf[n] = '\0';
  *len = n;
  return buf;
}

static void expect_asset(const char *path, const char *file, const char *type) {
  sp_coord_http_resp r;
  memset(&r, 0, sizeof r);
  assert_true(sp_coord_dashboard_asset(path, &r));
  assert_int_equal(r.status, 200);
  assert_string_equal(r.content_type, type);
  assert_true(r.body_static);
  assert_non_null(r.cache_control);
  assert_string_equal(r.cache_control, "no-cache");
  char fpath[512];
  snprintf(fpath, sizeof fpath, "%s/%s", DASHBOARD_DIR, file);
  size_t n;
  char *want = read_all(fpath, &n);
  assert_int_equal(r.len, n);
  assert_memory_equal(r.body, want, n);
  /* text: a NUL after it */
  assert_int_equal(r.body[r.len], '\0');
  free(want);
}

static void test_assets(void **state) {
  (void)state;
  expect_asset("/", "index.html", "text/html; charset=utf-8");
  expect_asset("/index.html", "index.html", "text/html; charset=utf-8");
  expect_asset("/app.js", "app.js", "text/javascript; charset=utf-8");
  expect_asset("/style.css", "style.css", "text/css; charset=utf-8");
}

static void test_unknown_paths(void **state) {
  (void)state;
  const char *paths[] = {
      "",   "/nope",     "/app.js/",   "/APP.JS",     "/dashboard/app.js",
      "//", "/app.js?x", "/../app.js", "/api/v1/job", "app.js"};
  for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
    sp_coord_http_resp r;
    memset(&r, 0x5a, sizeof r);
    sp_coord_http_resp before = r;
    if (sp_coord_dashboard_asset(paths[i], &r))
      fail_msg("\"%s\" is served", paths[i]);
    assert_memory_equal(&r, &before, sizeof r);
  }
  sp_coord_http_resp r;
  assert_false(sp_coord_dashboard_asset(NULL, &r));
}

/* The page's elements a headless check and an operator rely on. */
static void test_page_elements(void **state) {
  (void)state;
  sp_coord_http_resp r;
  assert_true(sp_coord_dashboard_asset("/", &r));
  const char *ids[] = {
      "id=\"verdict\"", "id=\"culprits\"",   "id=\"victims\"",
      "id=\"alerts\"",  "id=\"plan\"",       "id=\"buffers\"",
      "id=\"login\"",   "id=\"auth-error\"", "id=\"heatmap\"",
      "id=\"memmap\"",  "src=\"app.js\"",    "href=\"style.css\""};
  for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
    if (strstr(r.body, ids[i]) == NULL) fail_msg("the page lacks %s", ids[i]);
}

/* No markup from data, nothing from another site. */
static void test_page_promises(void **state) {
  (void)state;
  const char *files[] = {"/", "/app.js", "/style.css"};
  for (size_t i = 0; i < 3; i++) {
    sp_coord_http_resp r;
    assert_true(sp_coord_dashboard_asset(files[i], &r));
    assert_null(strstr(r.body, "innerHTML"));
    assert_null(strstr(r.body, "outerHTML"));
    assert_null(strstr(r.body, "insertAdjacentHTML"));
    assert_null(strstr(r.body, "document.write"));
    assert_null(strstr(r.body, "eval("));
    /* the one URL: the SVG namespace, a name, never fetched */
    for (const char *p = r.body; (p = strstr(p, "http")) != NULL; p++) {
      if (strncmp(p, "https://", 8) != 0 && strncmp(p, "http://", 7) != 0)
        continue;
      if (strncmp(p, "http://www.w3.org/2000/svg", 26) != 0)
        fail_msg("%s refers to %.60s", files[i], p);
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_assets),
      cmocka_unit_test(test_unknown_paths),
      cmocka_unit_test(test_page_elements),
      cmocka_unit_test(test_page_promises),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
