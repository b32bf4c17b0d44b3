/* The coordinator's /metrics (coord_metrics.c): the job, its ranks, the
 * hang diagnosis and the control plane in Prometheus's text exposition
 * format 0.0.4, every metric listed in docs/observability.md.
 *
 * Most of it is read from the other areas' state at each scrape; what no
 * area keeps the module gathers from the hub's bus as it happens: every
 * closed step's duration (SP_COORD_EV_STEP), the alerts raised by kind
 * and the time from each fault's evidence to its verdict
 * (SP_COORD_EV_ALERT), when the job's step last advanced
 * (SP_COORD_EV_TICK). Those are a few fixed arrays, nothing per rank.
 *
 * Per-rank series only up to cfg.metrics_rank_limit ranks (0:
 * SP_COORD_METRICS_RANK_LIMIT); above it aggregates alone, so that a
 * world of 100,000 ranks does not make 100,000 series of each.
 *
 * The module owns those counters. Threads: the loop thread only. */
#ifndef SP_COORD_METRICS_H
#define SP_COORD_METRICS_H

#include "base/textbuf.h"
#include "coord_bus.h"
#include "coord_http.h" /* SP_COORD_METRICS_RANK_LIMIT */
#include "coordinator.h"

/* The exposition's Content-Type. */
#define SP_COORD_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* From sp_coord_new / sp_coord_free (SP_ENOMEM). */
int sp_coord_metrics_init(sp_coord *c);
void sp_coord_metrics_free(sp_coord *c);

/* Appends the whole exposition to out. Linear in the world: one pass per
 * aggregate and per-rank family, and one allocation of the ranks' recent
 * step times for their quantiles (64 B a rank). Returns 0, or out's error
 * (SP_ENOMEM; SP_ETOOBIG past its bound), and then what it holds is not
 * to be served. */
int sp_coord_metrics_render(sp_coord *c, sp_textbuf *out);

/* The HTTP route of /metrics (coord_http.h): the exposition, or its
 * error with nothing served. */
int sp_coord_metrics_route(sp_coord *c, const char *path,
                           const sp_coord_http_query *q, sp_coord_http_resp *r);

/* Subscribers (coord_bus.h): the durations of the steps the message
 * closed (STEP); the count by kind and the diagnosis delay (ALERT); when
 * the job's step advanced, after the verdict's progress (TICK). */
int sp_coord_metrics_step(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_metrics_alert(sp_coord *c, void *user, const sp_coord_event *e);
int sp_coord_metrics_tick(sp_coord *c, void *user, const sp_coord_event *e);

#endif
