/* shardplane-coordinator: the job's single authority. One libuv loop runs
 * the gRPC server and every handler; other threads reach it only through
 * uv_async_send.
 *
 * This is the hub's header: the configuration, the coordinator's struct,
 * which holds every area's state (each area's own header, coord_*.h, says
 * what it owns), and the coordinator's lifetime. The hub (coord.c) sets
 * the areas up and wires them together on its bus (coord_bus.h): an area
 * announces what happened and the hub subscribed the areas that act on
 * it, so that no two areas call each other. */
#ifndef SP_COORDINATOR_H
#define SP_COORDINATOR_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "base/strmap.h"
#include "coord_auth.h"
#include "coord_bus.h"
#include "coord_diag.h"
#include "kvstore.h"
#include "plan/job.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "plan/state.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* Store limits (PyTorch TCPStore's), checked before allocating. */
#define SP_COORD_MAX_KEY (8u << 10)
#define SP_COORD_MAX_VALUE (8u << 20)
/* Messages must carry an 8 MiB store value plus framing. */
#define SP_COORD_MAX_MESSAGE (SP_COORD_MAX_VALUE + (64u << 10))
/* GetModelSpec pieces: the default size, and the most one answer carries
 * (below gRPC's customary 4 MiB receive limit, whatever the client). */
#define SP_COORD_SPEC_CHUNK (1u << 20)
#define SP_COORD_SPEC_CHUNK_MAX ((4u << 20) - (64u << 10))
/* Sizes of request strings, checked before anything is kept
 * (INVALID_ARGUMENT naming the field): a rank's host and device, the plan
 * version and session id, and the FQNs, prefixes and page tokens of the
 * plan queries. */
#define SP_COORD_MAX_HOST 255u
#define SP_COORD_MAX_DEVICE 63u
#define SP_COORD_MAX_VERSION 64u
#define SP_COORD_MAX_SESSION_ID 32u
#define SP_COORD_MAX_NAME 4096u
#define SP_COORD_MAX_PAGE_TOKEN 20u

/* Freed heap bytes over which the coordinator returns free pages to the
 * system (sp_rpc_server_opts.trim_heap_bytes): at most 80 B a rank left
 * resident at 100,000 ranks; each trim costs a walk of the free lists and
 * the page faults of what is reused, about 2,048 of them (0.5 ms) for
 * 8 MiB. */
#define SP_COORD_TRIM_BYTES (8u << 20)

/* The default loss grace: a long job loses more to a restart (every
 * rank back to its last checkpoint, often many minutes of every GPU) than
 * to a minute of waiting on a rank that turns out hung; a descheduled,
 * paging or I/O-stalled worker comes back well within it. Bounded all the
 * same: a rank silent for the timeout and this long is lost. */
#define SP_COORD_LOSS_GRACE_DEFAULT_MS 60000u

/* The default wait for more hosts once an elastic job has its fewest: the
 * agents of one job are started together (a Slurm step starts every task
 * at once) and register within a second or two of each other even on a
 * loaded host; every wait is paid again at each restart of the job. */
#define SP_COORD_JOIN_WAIT_DEFAULT_MS 5000u
#define SP_COORD_LOSS_GRACE_OFF UINT32_MAX

typedef struct sp_coord_config {
  const char *model_path;
  const char *job_path; /* may be NULL: the job comes from `job` alone */
  sp_job job;           /* flags, applied over the job file */
  uint32_t heartbeat_interval_ms; /* 0: 1000 */
  uint32_t heartbeat_timeout_ms;  /* 0: 5000 */
  bool quiet;                     /* no log lines (tests, benchmarks) */
  /* Durability (coord_persist.c): NULL keeps everything in memory. */
  const char *state_dir;
  /* After a restart on a state dir, how long a rank registered before may
   * take to reattach before it is declared lost; 0: 60000. */
  uint32_t reattach_grace_ms;
  /* Losses that are real (coord_ranks.c): how much longer than the
   * heartbeat timeout a silent rank is waited for while its agent says
   * its process is alive and its host is under pressure (or the rank
   * reported scheduling gaps); 0: SP_COORD_LOSS_GRACE_DEFAULT_MS,
   * SP_COORD_LOSS_GRACE_OFF: not at all (lost at the timeout). */
  uint32_t loss_grace_ms;
  /* --on-group-failure continue (coord_quorum.h): a HYBRID_SHARD job's
   * replica groups train on when one fails; false: every fault is the
   * job's (restart or end, as the agents' --max-restarts say). */
  bool groups_continue;
  /* Elastic nodes (coord_agents.c): once the fewest hosts the agents'
   * --nnodes MIN:MAX allow are registered, how long the job waits for
   * more (up to MAX) before it starts; 0: SP_COORD_JOIN_WAIT_DEFAULT_MS. */
  uint32_t join_wait_ms;
  /* The server's limits (sp_rpc_server_opts); 0 keeps the engine's
   * default. */
  uint32_t max_connections;
  uint64_t preface_timeout_ms, idle_timeout_ms, request_timeout_ms;
  size_t max_buffered;
  /* The token file (coord_auth.h); NULL: no authentication, every call is
   * served (in-process test fixtures, benchmarks). Read by sp_coord_new. */
  const char *token_file;
  sp_coord_auth_quota store_quota; /* per token; zeros: the defaults */
  /* NULL: cleartext. Needs to live only until sp_coord_listen returns. */
  const sp_rpc_tls_server_opts *tls;
  /* Hang diagnosis (coord_diag.h): thresholds, --on-stall, --dump-dir. */
  sp_coord_diag_config diag;
  /* The HTTP listener (coord_http.h): NULL: none. Its connections; 0:
   * SP_COORD_HTTP_MAX_CONNECTIONS. Per-rank series on /metrics up to this
   * many ranks; 0: SP_COORD_METRICS_RANK_LIMIT. The other limits and the
   * TLS and tokens are the gRPC port's. */
  const char *http_listen;
  uint32_t http_max_connections;
  uint32_t metrics_rank_limit;
} sp_coord_config;

typedef struct sp_coord_rank sp_coord_rank;
typedef struct sp_coord_watch sp_coord_watch;
typedef struct sp_coord_persist sp_coord_persist;

typedef struct sp_coord {
  uv_loop_t *loop;
  sp_rpc_server *srv;
  sp_model *model;
  /* The spec file's bytes exactly as read; the model was parsed from these
   * bytes, so GetModelSpec hands workers what the plan was built from. */
  char *spec_json;
  size_t spec_len;
  sp_job job;
  /* The plan of the current world. The job's configured world is the
   * largest (full_world, whose plan version names the job in a state
   * dir); elastic nodes run an incarnation on fewer (sp_coord_set_world). */
  sp_plan *plan;
  uint32_t full_world;
  char full_version[17];
  sp_coord_config cfg;
  uint64_t started_ms; /* uv_now at start */
  sp_coord_bus bus;    /* the hub's wiring (coord_bus.h) */
  /* ranks (coord_ranks.c) */
  sp_coord_rank *ranks; /* world_size entries */
  /* how many ranks have each status (Shardplane__V1__RankStatus) */
  uint32_t n_by_status[4];
  uv_timer_t heartbeat_timer;
  bool heartbeat_started;
  /* The loop's own pauses, seen as the heartbeat check firing late
   * (coord_ranks.c): when it last ran (sp_coord_base_now_ms), the longest
   * pause and their total, in ms. Not counted against any rank. */
  uint64_t hb_last_check_ms, loop_pause_max_ms, loop_pause_total_ms;
  uint64_t session_counter;
  struct sp_coord_alerts *alerts; /* coord_alerts.c */
  /* hang diagnosis (coord_diag.h): the record the detectors share, the
   * detectors (coord_desync.c, coord_stall.c, coord_straggler.c), the job's
   * state and verdict (coord_verdict.c); the recorders being gathered
   * (coord_dump.c) */
  sp_coord_diag *diag;
  struct sp_coord_desync *desync;
  struct sp_coord_stall *stall;
  struct sp_coord_straggler *straggler;
  struct sp_coord_verdict *verdict;
  struct trace_req *traces;
  uint64_t trace_counter;
  /* Watch streams (coord_events.c) */
  sp_coord_watch *watchers;
  /* store (coord_store.c) */
  sp_kvstore *store;
  struct sp_coord_store_wait *store_waits; /* calls waiting on keys */
  sp_coord_persist *persist;               /* NULL without a state dir */
  /* the hosts' agents and the job's incarnations (coord_agents.c) */
  struct sp_coord_agents *agents;
  struct sp_coord_quorum *quorum;   /* coord_quorum.c; NULL: none */
  sp_coord_auth *auth;              /* NULL without a token file */
  struct sp_coord_http *http;       /* coord_http.c; NULL: no HTTP listener */
  int http_port;                    /* its bound port */
  struct sp_coord_metrics *metrics; /* coord_metrics.c */
  struct sp_coord_history *history; /* the dashboard's series */
  /* Set by Abort: every Session stream gets ABORT with it, also one that
   * binds later, and no rank attaches any more. */
  char *abort_reason;
  bool abort_has_culprit;
  uint32_t abort_culprit;
  /* method tables registered with the server, owned here */
  sp_rpc_method *methods[8];
  size_t n_method_tables;
  bool shutting_down;
  int stopping; /* shutdown steps still running */
  void (*stop_done)(struct sp_coord *, void *);
  void *stop_arg;
} sp_coord;

/* Loads the model spec and job, builds the plan and the gRPC server (not yet
 * listening). Errors name the file or field at fault in diag. */
int sp_coord_new(uv_loop_t *loop, const sp_coord_config *cfg, sp_coord **out,
                 sp_diag *diag);
int sp_coord_listen(sp_coord *c, const char *addr, int *port, sp_diag *diag);
/* Graceful stop: ends sessions and watches, then the server. */
void sp_coord_shutdown(sp_coord *c, void (*done)(sp_coord *, void *),
                       void *arg);
void sp_coord_free(sp_coord *c);
/* The world of the next incarnation (elastic nodes), between two: the
 * plan is built for `world` ranks and everything sized by the world made
 * again for it; the ranks of the last world are forgotten (their streams
 * ended). Loop thread only. Errors (a plan the job cannot have at that
 * size, out of memory) leave the world as it was and say why in diag. */
int sp_coord_set_world(sp_coord *c, uint32_t world, sp_diag *diag);

#endif
