/* The coordinator's HTTP listener (--http-listen): /metrics for
 * Prometheus, the dashboard at / and the JSON API it polls (/api/v1/...),
 * /healthz. GNU libmicrohttpd parses HTTP/1.1; it runs without threads of
 * its own, driven from the coordinator's libuv loop (its epoll fd watched
 * by a uv_poll, its timeout by a uv_timer), so every route reads the
 * coordinator's state on the loop thread like the gRPC handlers do.
 *
 * The listener obeys the gRPC port's limits (connections, idle and
 * request timeouts, bytes buffered) and its trust: TLS with the
 * coordinator's certificate when it has one; a bearer token of the
 * reader or admin role on every path but /healthz (the Authorization
 * header, as Prometheus sends it, or the dashboard's session cookie that
 * POST /login gives for such a token).
 *
 * Routes are the other areas' (coord_metrics.c, coord_api.c,
 * coord_dashboard.c): each fills an sp_coord_http_resp.
 *
 * Threads: the loop thread only. */
#ifndef SP_COORD_HTTP_H
#define SP_COORD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"

struct sp_coord;

/* The query arguments of a request (decoded), at most SP_COORD_HTTP_ARGS;
 * later ones are ignored. Borrowed for the route's call. */
#define SP_COORD_HTTP_ARGS 8u
typedef struct sp_coord_http_query {
  const char *key[SP_COORD_HTTP_ARGS], *value[SP_COORD_HTTP_ARGS];
  size_t n;
} sp_coord_http_query;

/* The value of key ("" for one given without a value), or NULL when it
 * was not given; q may be NULL. */
const char *sp_coord_http_arg(const sp_coord_http_query *q, const char *key);

/* What a route answers. body is malloc'd and handed to the listener,
 * unless body_static (then it must outlive the process: embedded
 * assets). */
typedef struct sp_coord_http_resp {
  unsigned status;          /* 0: 200 */
  const char *content_type; /* a static string */
  char *body;
  size_t len;
  bool body_static;
  /* NULL: "no-store" (live data); assets may be cached */
  const char *cache_control;
} sp_coord_http_resp;

/* Defaults and bounds of the listener (the flags of coord_main.c). */
#define SP_COORD_HTTP_MAX_CONNECTIONS 256u
#define SP_COORD_HTTP_PER_IP_CONNECTIONS 64u
#define SP_COORD_HTTP_TIMEOUT_S 30u
#define SP_COORD_HTTP_CONN_MEMORY (64u << 10)
/* Per-rank series on /metrics up to this many ranks; aggregates only
 * above (--metrics-rank-limit). */
#define SP_COORD_METRICS_RANK_LIMIT 1024u
/* Dashboard sessions: how long a login lasts, and how many at once. */
#define SP_COORD_HTTP_SESSION_S (12u * 3600u)
#define SP_COORD_HTTP_MAX_SESSIONS 1024u

/* Who may read a route. */
typedef enum sp_coord_http_access {
  SP_COORD_HTTP_OPEN,   /* anyone: /healthz, the page's scripts and style */
  SP_COORD_HTTP_HEADER, /* a reader or admin token in the Authorization
                           header: /metrics, as Prometheus sends it */
  SP_COORD_HTTP_READER, /* the header or the dashboard's session cookie */
  /* the dashboard's page: served to anyone, but with 401 without the
   * header or cookie, so that it shows its login form */
  SP_COORD_HTTP_PAGE,
} sp_coord_http_access;

/* A route answers a GET (or HEAD) of path: 0 with r filled, or a negative
 * SP_E* (the listener answers 500, or 503 for SP_ENOMEM). */
typedef int (*sp_coord_http_route_fn)(struct sp_coord *c, const char *path,
                                      const sp_coord_http_query *q,
                                      sp_coord_http_resp *r);
typedef struct sp_coord_http_route {
  const char *path; /* "/metrics"; with prefix, "/api/" */
  bool prefix;
  sp_coord_http_access access;
  sp_coord_http_route_fn fn;
} sp_coord_http_route;

/* From sp_coord_listen when cfg.http_listen is set: binds addr
 * ("HOST:PORT", port 0 picks a free one) and serves routes (static, the
 * first match wins; the listener's own /login and /logout come first);
 * *port gets the bound port. SP_EIO with the reason in diag (address in
 * use, TLS material unreadable or unsupported), SP_ENOMEM. */
int sp_coord_http_start(struct sp_coord *c, const char *addr,
                        const sp_coord_http_route *routes, size_t n_routes,
                        int *port, sp_diag *diag);
/* Stops accepting and closes every connection and handle; closed(c) runs
 * once the handles are released (at once when never started). */
void sp_coord_http_shutdown(struct sp_coord *c, void (*closed)(void *));
void sp_coord_http_free(struct sp_coord *c);

/* The listener's counters (/metrics); zeros without a listener. */
typedef struct sp_coord_http_stats {
  uint64_t connections_open;
  uint64_t requests_total;
  uint64_t unauthorized_total; /* answered 401 or 403 */
  uint64_t bytes_out;          /* response bodies */
} sp_coord_http_stats;
void sp_coord_http_get_stats(const struct sp_coord *c, sp_coord_http_stats *s);

#endif
