/* The dashboard's page (coord_dashboard.c): server/dashboard/index.html,
 * app.js and style.css, compiled into the coordinator at build time
 * (cmake/embed.cmake), so that the binary serves its own page with
 * nothing to install beside it and no request leaves for another site.
 * The page polls the JSON API (coord_api.h); docs/dashboard-api.md.
 *
 * Threads: any; the assets are constant. */
#ifndef SP_COORD_DASHBOARD_H
#define SP_COORD_DASHBOARD_H

#include <stdbool.h>

#include "coord_http.h"

/* The asset at path ("/" and "/index.html": the page, "/app.js",
 * "/style.css"): true with r filled (200, its type with charset=utf-8,
 * body_static, "no-cache": a browser asks again, so an upgraded
 * coordinator's page is never mixed with the last one's script); false
 * for any other path (r untouched). */
bool sp_coord_dashboard_asset(const char *path, sp_coord_http_resp *r);
/* The same as an HTTP route (coord_http.h): 404 for another path. */
int sp_coord_dashboard_route(struct sp_coord *c, const char *path,
                             const sp_coord_http_query *q,
                             sp_coord_http_resp *r);

#endif
