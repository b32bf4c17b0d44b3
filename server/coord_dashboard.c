/* The dashboard's assets, from the arrays the build generated. */
#include "coord_dashboard.h"

#include <stddef.h>
#include <string.h>

/* generated into the build tree by cmake/embed.cmake */
extern const unsigned char sp_dashboard_index_html[];
extern const size_t sp_dashboard_index_html_len;
extern const unsigned char sp_dashboard_app_js[];
extern const size_t sp_dashboard_app_js_len;
extern const unsigned char sp_dashboard_style_css[];
extern const size_t sp_dashboard_style_css_len;

static const struct asset {
  const char *path;
  const unsigned char *data;
  const size_t *len;
  const char *type;
} k_assets[] = {
    {"/", sp_dashboard_index_html, &sp_dashboard_index_html_len,
     "text/html; charset=utf-8"},
    {"/index.html", sp_dashboard_index_html, &sp_dashboard_index_html_len,
     "text/html; charset=utf-8"},
    {"/app.js", sp_dashboard_app_js, &sp_dashboard_app_js_len,
     "text/javascript; charset=utf-8"},
    {"/style.css", sp_dashboard_style_css, &sp_dashboard_style_css_len,
     "text/css; charset=utf-8"},
};

bool sp_coord_dashboard_asset(const char *path, sp_coord_http_resp *r) {
  if (path == NULL) return false;
  for (size_t i = 0; i < sizeof k_assets / sizeof k_assets[0]; i++) {
    const struct asset *a = &k_assets[i];
    if (strcmp(path, a->path) != 0) continue;
    r->status = 200;
    r->content_type = a->type;
    /* never written through: body_static says so to the listener */
    r->body = (char *)a->data;
    r->len = *a->len;
    r->body_static = true;
    r->cache_control = "no-cache";
    return true;
  }
  return false;
}

int sp_coord_dashboard_route(struct sp_coord *c, const char *path,
                             const sp_coord_http_query *q,
                             sp_coord_http_resp *r) {
  (void)c;
  (void)q;
  if (sp_coord_dashboard_asset(path, r)) return 0;
  static const char nf[] = "not found\n";
  r->status = 404;
  r->content_type = "text/plain; charset=utf-8";
  r->body = (char *)nf;
  r->len = sizeof nf - 1;
  r->body_static = true;
  return 0;
}
