/* The FSDP runtime (client/lib/fsdp*.c) in isolation: its schedule and its
 * mechanics. W = 1..4 ranks run as threads of this process, each with its
 * own session against one in-process coordinator, its own Gloo
 * communicators (sp_fsdp_comms_open) and its own runtime, driven in the
 * order the worker's trainers use (client/worker/mlp_train.c), but with
 * synthetic gradients whose reduced values are known exactly, so every check is an equality:
 *  - unshard: every rank's views hold the whole parameter in param_dtype,
 *    for FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, with float32
 *    and bfloat16 (docs/fsdp.md, "Mixed precision");
 *  - reshard: views freed or kept as each strategy says (docs/fsdp.md,
 *    "Sharding strategies");
 *  - reduction: the shard gradient is the mean over ranks, through
 *    reduce_dtype, with FSDP's divide factors (float16 values that
 *    overflow without the pre-divide and vanish with too large a one);
 *    keep_low_precision_grads leaves it in param_dtype ("Mixed precision");
 *  - SGD on the shard; sp_fsdp_gather_param;
 *  - backward prefetch and the all-gather limiter ("Prefetch and the
 *    all-gather limiter");
 *  - illegal schedules refused with SP_ESTATE, before any collective;
 *  - a unit prefetched but skipped in backward is not reused stale;
 *  - the coordinator sees every transition and collective (ListRanks);
 *  - lazy init casts buffers once, to their compute dtype ("Buffers").
 *
 * cmocka's assertions longjmp, which is only valid on the test's own
 * thread, so rank threads (support/rank_threads.h) record their first
 * failure (and abort every rank's communicators so nobody waits for a
 * timeout); the main thread asserts after joining them. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "base/clock.h"
#include "cast/cast.h"
#include "support/coord_fixture.h"
#include "server/coordinator.h"
#include "worker/mlp.h"
#include "lib/session/session_internal.h"
#include "lib/shardplane.h"
#include "support/rank_threads.h"
#include "support/testutil.h"

#define MAX_W 4
#define MLP SP_EXAMPLES "/mlp.json"
#define MLP_BUFFERS SP_TEST_DATA "/mlp_buffers.json"
#define LR 0.125 /* a power of two: lr * g is exact, p - lr*g rounds once */

/* The synthetic spec (written by the group setup): 8 units, sizes that
 * leave padding for every W, and one unit of a single element (N < W). */
static char *g_dir;
static char *g_synth;

/* ---- a job: coordinator, W rank threads ---- */

typedef struct job_cfg {
  const char *model;
  uint32_t world;
  sp_strategy strategy; /* as asked; W = 1 makes every strategy NO_SHARD */
  uint32_t group;       /* HYBRID_SHARD shard-group size */
  sp_dtype param_dtype; /* SP_DTYPE_INVALID: unset (float32 below) */
  sp_dtype reduce_dtype;
  sp_dtype buffer_dtype;
  bool keep_low;
  bool prefetch;         /* sp_fsdp_opts.backward_prefetch */
  uint32_t max_inflight; /* sp_fsdp_opts.max_inflight_gathers */
} job_cfg;

typedef struct harness harness;

typedef struct rank_ctx {
  sp_test_rank t; /* first: the harness's callbacks cast back */
  harness *h;
  sp_session *s;
  sp_fsdp *f;
  const sp_plan *plan;
  const sp_model *model;
  /* what the test expects, derived from the job flags, not from the plan */
  sp_strategy strategy;
  uint32_t shard_world;
  sp_dtype pdt; /* param_dtype of every unit */
  sp_dtype gdt; /* dtype of the reduced shard gradient */
  /* per unit: the full master parameter as the test computes it */
  float **flat;
  uint64_t transitions; /* legal transitions made: the coordinator's count */
  uint64_t summons;     /* sp_fsdp_gather_param calls (one all-gather each) */
  sp_fsdp_stats stats;  /* at the end of the body */
} rank_ctx;

typedef int (*rank_body)(rank_ctx *c, void *arg);

struct harness {
  job_cfg cfg;
  sp_coord_fixture fx;
  rank_body body;
  void *arg;
  rank_ctx ranks[MAX_W];
  sp_test_ranks job;
};

#define CHECK(c, ...) SP_RANK_CHECK(&(c)->t, __VA_ARGS__)
/* A call that must succeed; `expr` passes &D as its diag. */
#define CALL(c, expr) SP_RANK_CALL(&(c)->t, expr)
#define TRY(expr) SP_RANK_TRY(expr)

/* A schedule call that must succeed and makes k transitions. */
#define SCHED(c, k, expr)    \
  do {                       \
    CALL(c, expr);           \
    (c)->transitions += (k); \
  } while (0)

/* A call that must be refused with `code` and a message holding `what`
 * (NULL: any). */
static int refused(rank_ctx *c, const char *file, int line, const char *expr,
                   int rc, const sp_diag *d, int code, const char *what) {
  if (rc != code)
    return sp_test_rank_fail(&c->t, file, line, "%s: %s (%s), want %s", expr,
                             sp_err_name(rc), d->msg, sp_err_name(code));
  if (what != NULL && strstr(d->msg, what) == NULL)
    return sp_test_rank_fail(&c->t, file, line,
                             "%s: message \"%s\" does not say \"%s\"", expr,
                             d->msg, what);
  return 0;
}

#define REFUSED(c, code, what, expr)                                      \
  do {                                                                    \
    sp_diag D = {""};                                                     \
    int rc_ = (expr);                                                     \
    if (refused((c), __FILE__, __LINE__, #expr, rc_, &D, (code), (what))) \
      return -1;                                                          \
  } while (0)

static uint32_t n_units(const rank_ctx *c) {
  return (uint32_t)c->plan->n_units;
}

static bool is_sharded(const rank_ctx *c) { return c->strategy != SP_NO_SHARD; }

/* FULL_SHARD and HYBRID_SHARD free after forward, but not the root unit. */
static bool frees_after_forward(const rank_ctx *c, uint32_t u) {
  return u != 0 &&
         (c->strategy == SP_FULL_SHARD || c->strategy == SP_HYBRID_SHARD);
}

static int64_t unit_numel(const rank_ctx *c, uint32_t u) {
  return c->plan->units[u].numel;
}

/* Elements every rank holds: c = ceil(N / shard world), N for NO_SHARD. */
static int64_t shard_elems(const rank_ctx *c, uint32_t u) {
  int64_t n = unit_numel(c, u);
  if (!is_sharded(c)) return n;
  return (n + c->shard_world - 1) / c->shard_world;
}

/* [start, end) of the flat parameter in this rank's shard (docs/fsdp.md,
 * "Shard math"). */
static void shard_range(const rank_ctx *c, uint32_t u, int64_t *start,
                        int64_t *end) {
  int64_t n = unit_numel(c, u), cc = shard_elems(c, u);
  uint32_t idx = !is_sharded(c)                   ? 0
                 : c->strategy == SP_HYBRID_SHARD ? c->t.rank % c->shard_world
                                                  : c->t.rank;
  int64_t s = (int64_t)idx * cc;
  *start = s < n ? s : n;
  *end = s + cc < n ? s + cc : n;
}

static int64_t param_offset(const rank_ctx *c, int32_t p) {
  return c->plan->entries[c->plan->param_entry[p]].offset;
}

static bool param_in_unit(const rank_ctx *c, size_t p, uint32_t u) {
  return c->plan->param_unit[p] == (int32_t)u;
}

/* ---- synthetic gradients ---- */

typedef struct grad_fn {
  /* what rank c->t.rank writes at flat index j of unit u */
  double (*value)(const rank_ctx *c, uint32_t u, int64_t j);
  /* the reduced gradient there: the mean over ranks */
  double (*mean)(const rank_ctx *c, uint32_t u, int64_t j);
} grad_fn;

/* k/64 with |k| <= 30: times rank+1 <= 4, halved by the pre-divide, summed
 * over 4 ranks and divided again, every intermediate has at most 8
 * significant bits, so it is exact in bfloat16 and float16 too and the
 * reduced value must equal the mean exactly, in every strategy. */
static double grad_base(uint32_t u, int64_t j) {
  return (double)((j * 37 + (int64_t)u * 11) % 61 - 30) / 64.0;
}

static double rank_grad(const rank_ctx *c, uint32_t u, int64_t j) {
  return (c->t.rank + 1) * grad_base(u, j);
}

/* mean over r of (r+1) * base = base * (W+1)/2 */
static double rank_grad_mean(const rank_ctx *c, uint32_t u, int64_t j) {
  return grad_base(u, j) * (c->h->cfg.world + 1) / 2.0;
}

static const grad_fn k_rank_grads = {rank_grad, rank_grad_mean};

/* ---- checks ---- */

/* Every parameter of unit u: the view exists, has the unit's param dtype
 * and holds exactly the full master parameter cast to it. */
static int check_views(rank_ctx *c, uint32_t u, const char *when) {
  const sp_model *m = c->model;
  size_t ps = sp_dtype_size(c->pdt);
  for (size_t p = 0; p < m->n_params; p++) {
    if (!param_in_unit(c, p, u)) continue;
    const uint8_t *v = sp_fsdp_param(c->f, (int32_t)p);
    CHECK(c, v != NULL, "%s: %s has no view", when, m->params[p].fqn);
    CHECK(c, sp_fsdp_param_dtype(c->f, (int32_t)p) == c->pdt,
          "%s: %s view is %s, want %s", when, m->params[p].fqn,
          sp_dtype_name(sp_fsdp_param_dtype(c->f, (int32_t)p)),
          sp_dtype_name(c->pdt));
    size_t n = (size_t)m->params[p].numel;
    uint8_t *want = malloc(n * ps);
    CHECK(c, want != NULL, "no memory");
    sp_cast(want, c->pdt, c->flat[u] + param_offset(c, (int32_t)p), SP_FLOAT32,
            n);
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
      if (memcmp(v + i * ps, want + i * ps, ps) != 0) bad = i;
    free(want);
    CHECK(c, bad == n,
          "%s: %s element %zu of the view differs from the "
          "full parameter",
          when, m->params[p].fqn, bad);
  }
  return 0;
}

static int check_no_views(rank_ctx *c, uint32_t u, const char *when) {
  for (size_t p = 0; p < c->model->n_params; p++)
    if (param_in_unit(c, p, u))
      CHECK(c, sp_fsdp_param(c->f, (int32_t)p) == NULL,
            "%s: %s still has a view", when, c->model->params[p].fqn);
  return 0;
}

/* After a reshard: sharded strategies free, NO_SHARD keeps. */
static int check_resharded(rank_ctx *c, uint32_t u, const char *when) {
  return is_sharded(c) ? check_no_views(c, u, when) : check_views(c, u, when);
}

static int write_grads(rank_ctx *c, uint32_t u, const grad_fn *gf) {
  const sp_model *m = c->model;
  for (size_t p = 0; p < m->n_params; p++) {
    if (!param_in_unit(c, p, u)) continue;
    void *g = sp_fsdp_param_grad(c->f, (int32_t)p);
    CHECK(c, g != NULL, "%s has no gradient buffer", m->params[p].fqn);
    size_t n = (size_t)m->params[p].numel;
    int64_t off = param_offset(c, (int32_t)p);
    float *tmp = malloc(n * sizeof *tmp);
    CHECK(c, tmp != NULL, "no memory");
    for (size_t i = 0; i < n; i++)
      tmp[i] = (float)gf->value(c, u, off + (int64_t)i);
    int rc = sp_cast(g, c->pdt, tmp, SP_FLOAT32, n);
    free(tmp);
    CHECK(c, rc == 0, "cast of the gradient of %s", m->params[p].fqn);
  }
  return 0;
}

/* The reduced shard gradient of unit u: the mean over ranks of the
 * synthetic gradients in this rank's range, zero in the padding, in the
 * expected dtype. */
static int check_shard_grad(rank_ctx *c, uint32_t u, const grad_fn *gf) {
  int64_t numel = -1, start, end, cc = shard_elems(c, u);
  CHECK(c, sp_fsdp_shard(c->f, u, &numel) != NULL, "unit %u has no shard", u);
  CHECK(c, numel == cc, "unit %u shard has %lld elements, want %lld", u,
        (long long)numel, (long long)cc);
  CHECK(c, sp_fsdp_shard_grad_dtype(c->f, u) == c->gdt,
        "unit %u shard gradient is %s, want %s", u,
        sp_dtype_name(sp_fsdp_shard_grad_dtype(c->f, u)),
        sp_dtype_name(c->gdt));
  const void *g = sp_fsdp_shard_grad(c->f, u);
  CHECK(c, g != NULL, "unit %u has no shard gradient", u);
  float *got = malloc((size_t)cc * sizeof *got);
  CHECK(c, got != NULL, "no memory");
  sp_cast(got, SP_FLOAT32, g, c->gdt, (size_t)cc);
  shard_range(c, u, &start, &end);
  int64_t bad = -1;
  float want = 0;
  for (int64_t k = 0; k < cc && bad < 0; k++) {
    want = k < end - start ? (float)gf->mean(c, u, start + k) : 0.0f;
    if (!(got[k] == want)) bad = k;
  }
  float gotv = bad >= 0 ? got[bad] : 0;
  free(got);
  CHECK(c, bad < 0,
        "unit %u shard gradient[%lld] (flat %lld) = %.9g, want "
        "%.9g",
        u, (long long)bad, (long long)(start + bad), (double)gotv,
        (double)want);
  return 0;
}

/* The master shard of unit u equals the test's copy in this rank's range
 * and zero in the padding. */
static int check_shard(rank_ctx *c, uint32_t u) {
  int64_t numel, start, end;
  const float *sh = sp_fsdp_shard(c->f, u, &numel);
  CHECK(c, sh != NULL && numel == shard_elems(c, u), "unit %u shard", u);
  shard_range(c, u, &start, &end);
  for (int64_t k = 0; k < numel; k++) {
    float want = k < end - start ? c->flat[u][start + k] : 0.0f;
    CHECK(c, memcmp(&sh[k], &want, sizeof want) == 0,
          "unit %u shard[%lld] = %.9g, want %.9g", u, (long long)k,
          (double)sh[k], (double)want);
  }
  return 0;
}

/* sp_fsdp_gather_param of every parameter (a collective: all ranks, same
 * order) equals the test's master copy; with resync, takes it instead. */
static int check_master(rank_ctx *c, bool resync) {
  const sp_model *m = c->model;
  for (size_t p = 0; p < m->n_params; p++) {
    size_t n = (size_t)m->params[p].numel;
    uint32_t u = (uint32_t)c->plan->param_unit[p];
    float *full = calloc(n, sizeof *full);
    CHECK(c, full != NULL, "no memory");
    sp_diag D = {""};
    int rc = sp_fsdp_gather_param(c->f, (int32_t)p, full, &D);
    if (rc != 0) free(full);
    CHECK(c, rc == 0, "gather_param %s: %s", m->params[p].fqn, D.msg);
    /* root and handle into SUMMON_FULL_PARAMS and back */
    c->transitions += 4;
    c->summons++;
    float *mine = c->flat[u] + param_offset(c, (int32_t)p);
    size_t bad = n;
    if (resync)
      memcpy(mine, full, n * sizeof *full);
    else
      for (size_t i = 0; i < n && bad == n; i++)
        if (memcmp(&full[i], &mine[i], sizeof *full) != 0) bad = i;
    float gotv = bad < n ? full[bad] : 0, wantv = bad < n ? mine[bad] : 0;
    free(full);
    CHECK(c, bad == n, "gather_param %s[%zu] = %.9g, want %.9g",
          m->params[p].fqn, bad, (double)gotv, (double)wantv);
  }
  return 0;
}

/* SGD on the shards, and on the test's copy: p = round(p - lr*g) with the
 * mean gradient (exact in every dtype used here). skip: a unit whose
 * backward did not run (0: none); what SGD does to it is not checked, the
 * next step resyncs it. */
static int sgd(rank_ctx *c, double lr, uint32_t skip, const grad_fn *gf) {
  CALL(c, sp_fsdp_sgd_step(c->f, lr, &D));
  for (uint32_t u = 0; u < n_units(c); u++) {
    if (skip && u == skip) continue;
    for (int64_t j = 0; j < unit_numel(c, u); j++) {
      float g = (float)gf->mean(c, u, j);
      c->flat[u][j] = (float)((double)c->flat[u][j] - lr * (double)g);
    }
    TRY(check_shard(c, u));
  }
  return 0;
}

/* ---- the schedule, as client/worker/mlp_train.c runs it ---- */

static int forward(rank_ctx *c, bool check) {
  SCHED(c, 2, sp_fsdp_root_pre_forward(c->f, &D));
  if (check) TRY(check_views(c, 0, "after root_pre_forward"));
  for (uint32_t u = 1; u < n_units(c); u++) {
    SCHED(c, 1, sp_fsdp_pre_forward(c->f, u, &D));
    if (check) TRY(check_views(c, u, "after pre_forward"));
    SCHED(c, 1, sp_fsdp_post_forward(c->f, u, &D));
    if (check)
      TRY(frees_after_forward(c, u) ? check_no_views(c, u, "after post_forward")
                                    : check_views(c, u, "after post_forward"));
  }
  SCHED(c, 2, sp_fsdp_root_post_forward(c->f, &D));
  /* the root unit stays unsharded for the backward that follows */
  if (check) TRY(check_views(c, 0, "after root_post_forward"));
  return 0;
}

/* Backward in reverse unit order, writing gradients; skip (not 0): a unit
 * whose backward does not run (its outputs needed no gradient). */
static int backward(rank_ctx *c, bool check, uint32_t skip, const grad_fn *gf) {
  SCHED(c, 2, sp_fsdp_root_pre_backward(c->f, &D));
  if (check) TRY(check_views(c, 0, "after root_pre_backward"));
  TRY(write_grads(c, 0, gf));
  for (uint32_t u = n_units(c); u-- > 1;) {
    if (u == skip) continue;
    SCHED(c, 1, sp_fsdp_pre_backward(c->f, u, &D));
    if (check) TRY(check_views(c, u, "after pre_backward"));
    TRY(write_grads(c, u, gf));
    SCHED(c, 1, sp_fsdp_post_backward(c->f, u, &D));
    if (check) TRY(check_resharded(c, u, "after post_backward"));
  }
  SCHED(c, 1, sp_fsdp_post_backward(c->f, 0, &D));
  if (check) TRY(check_resharded(c, 0, "after post_backward(0)"));
  /* every unit that ran its backward back to IDLE, then the root */
  SCHED(c, n_units(c) - (skip ? 1 : 0) + 1, sp_fsdp_finish_backward(c->f, &D));
  for (uint32_t u = 0; check && u < n_units(c); u++)
    TRY(check_resharded(c, u, "after finish_backward"));
  for (uint32_t u = 0; u < n_units(c); u++)
    if (!skip || u != skip) TRY(check_shard_grad(c, u, gf));
  return 0;
}

typedef struct step_opts {
  uint64_t step;
  double lr;     /* 0: no SGD */
  uint32_t skip; /* a non-root unit whose backward does not run */
  bool resync;   /* take the master from gather_param, not check it */
  const grad_fn *gf;
} step_opts;

static int run_step(rank_ctx *c, const step_opts *so) {
  const grad_fn *gf = so->gf ? so->gf : &k_rank_grads;
  TRY(check_master(c, so->resync));
  sp_session_set_step(c->s, so->step);
  TRY(forward(c, true));
  TRY(backward(c, true, so->skip, gf));
  if (so->lr != 0) TRY(sgd(c, so->lr, so->skip, gf));
  return 0;
}

/* ---- rank threads ---- */

static int rank_setup(rank_ctx *c) {
  harness *h = c->h;
  TRY(sp_test_rank_attach(&c->t, h->fx.addr, &c->s));
  c->plan = sp_session_plan(c->s);
  c->model = sp_session_model(c->s);
  sp_fsdp_opts fo = {.session = c->s,
                     .world = c->t.comm[0],
                     .shard_group = c->t.comm[1],
                     .replica_group = c->t.comm[2],
                     .backward_prefetch = h->cfg.prefetch,
                     .max_inflight_gathers = h->cfg.max_inflight,
                     .init_param = sp_mlp_init_param,
                     .init_buffer = sp_mlp_init_buffer};
  CALL(c, sp_fsdp_new(&fo, &c->f, &D));
  /* the test's own master copy, from the same initialiser */
  const sp_model *m = c->model;
  c->flat = calloc(n_units(c), sizeof *c->flat);
  CHECK(c, c->flat != NULL, "no memory");
  for (uint32_t u = 0; u < n_units(c); u++) {
    c->flat[u] = calloc((size_t)unit_numel(c, u) + 1, sizeof(float));
    CHECK(c, c->flat[u] != NULL, "no memory");
  }
  for (size_t p = 0; p < m->n_params; p++) {
    CHECK(c, m->params[p].dtype == SP_FLOAT32, "%s is not float32",
          m->params[p].fqn);
    uint32_t u = (uint32_t)c->plan->param_unit[p];
    sp_mlp_init_param(NULL, m, (int32_t)p, 0, m->params[p].numel,
                      c->flat[u] + param_offset(c, (int32_t)p));
  }
  return 0;
}

/* Once the main thread has read ListRanks: the job holds the ranks till
 * then. */
static void rank_teardown(sp_test_rank *t) {
  rank_ctx *c = (rank_ctx *)t;
  sp_fsdp_free(c->f);
  if (c->flat)
    for (uint32_t u = 0; u < n_units(c); u++) free(c->flat[u]);
  free(c->flat);
  sp_test_rank_detach(&c->t, c->s);
}

static int rank_run(sp_test_rank *t) {
  rank_ctx *c = (rank_ctx *)t;
  TRY(rank_setup(c));
  TRY(c->h->body(c, c->h->arg));
  sp_fsdp_get_stats(c->f, &c->stats);
  /* everything queued reaches the coordinator before it is asked */
  CALL(c, sp_session_flush(c->s, 10000, &D));
  return 0;
}

#define free_msg sp_test_free_msg

/* What the coordinator says about each rank after the body: attached, the
 * root and every unit IDLE, exactly the transitions the rank made, no
 * alert, and as many collectives as the runtime issued. Returns a message
 * on the first difference (the main thread asserts once ranks are done). */
static void check_coordinator(harness *h, char *err, size_t cap) {
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  q.with_unit_states = true;
  sp_rpc_status st;
  ProtobufCMessage *resp = NULL;
  int rc = sp_rpc_sync_unary(h->fx.cli, SP_COORD_PATH("ListRanks"), &q.base,
                             &shardplane__v1__list_ranks_response__descriptor,
                             5000, &resp, &st);
  if (rc != 0 || st.code != SP_RPC_OK) {
    snprintf(err, cap, "ListRanks: %d %.200s", rc, st.message);
    free_msg(resp);
    return;
  }
  Shardplane__V1__ListRanksResponse *l =
      (Shardplane__V1__ListRanksResponse *)resp;
  if (l->n_ranks != h->cfg.world) {
    snprintf(err, cap, "ListRanks: %zu ranks, want %u", l->n_ranks,
             h->cfg.world);
    goto out;
  }
  for (uint32_t r = 0; r < h->cfg.world; r++) {
    const rank_ctx *c = &h->ranks[r];
    const Shardplane__V1__RankInfo *ri = l->ranks[r];
    const sp_fsdp_stats *s = &c->stats;
    /* NO_SHARD's unshard is a copy, not a collective */
    uint64_t colls = s->reduce_scatters + s->all_reduces +
                     (is_sharded(c) ? s->all_gathers + c->summons : 0);
    uint64_t seq = ri->last_collective ? ri->last_collective->seq : 0;
    /* each communicator numbers its own collectives: together they are
     * what the runtime issued, and the last one reported (its completion)
     * is the last one of some communicator */
    uint64_t per_comm[3], sum = 0;
    bool last_seen = false;
    for (int k = 0; k < 3; k++) {
      sum += per_comm[k] = sp_session_coll_seq(c->s, (sp_comm_kind)k);
      last_seen = last_seen || (per_comm[k] != 0 && per_comm[k] == seq);
    }
    if (ri->status != SHARDPLANE__V1__RANK_STATUS__ATTACHED)
      snprintf(err, cap, "rank %u: status %d", r, (int)ri->status);
    else if (ri->root_state != SP_ROOT_IDLE)
      snprintf(err, cap, "rank %u: root state %d", r, ri->root_state);
    else if (ri->n_unit_states != c->plan->n_units)
      snprintf(err, cap, "rank %u: %zu unit states", r, ri->n_unit_states);
    else if (ri->transitions != c->transitions)
      snprintf(err, cap,
               "rank %u: coordinator counted %llu transitions, "
               "the rank made %llu",
               r, (unsigned long long)ri->transitions,
               (unsigned long long)c->transitions);
    else if (ri->alerts != 0)
      snprintf(err, cap, "rank %u: %u alerts: %s", r, ri->alerts,
               ri->last_alert);
    else if (sum != colls)
      snprintf(err, cap,
               "rank %u: %llu collectives reported, the runtime "
               "issued %llu",
               r, (unsigned long long)sum, (unsigned long long)colls);
    else if (sum > 0 && !last_seen)
      snprintf(err, cap,
               "rank %u: last collective #%llu, the runtime's "
               "last were %llu, %llu, %llu",
               r, (unsigned long long)seq, (unsigned long long)per_comm[0],
               (unsigned long long)per_comm[1],
               (unsigned long long)per_comm[2]);
    for (size_t u = 0; !err[0] && u < ri->n_unit_states; u++)
      if (ri->unit_states[u] != SP_HANDLE_IDLE)
        snprintf(err, cap, "rank %u: unit %zu state %d", r, u,
                 ri->unit_states[u]);
    if (err[0]) break;
  }
out:
  free_msg(resp);
}

/* Runs body on every rank of a fresh coordinator started for cfg, then
 * checks the coordinator's view; prints the wall time. */
static void run_job(const job_cfg *cfg, rank_body body, void *arg) {
  double t0 = sp_clock_s();
  harness *h = calloc(1, sizeof *h);
  assert_non_null(h);
  assert_true(cfg->world >= 1 && cfg->world <= MAX_W);
  h->cfg = *cfg;
  h->body = body;
  h->arg = arg;
  char ws[16], gs[16];
  snprintf(ws, sizeof ws, "%u", cfg->world);
  snprintf(gs, sizeof gs, "%u", cfg->group);
  const char *flags[32];
  size_t k = 0;
  flags[k++] = "world-size";
  flags[k++] = ws;
  flags[k++] = "wrap-type";
  flags[k++] = "Linear";
  flags[k++] = "strategy";
  flags[k++] = sp_strategy_name(cfg->strategy);
  if (cfg->strategy == SP_HYBRID_SHARD) {
    flags[k++] = "shard-group-size";
    flags[k++] = gs;
  }
  if (cfg->param_dtype) {
    flags[k++] = "param-dtype";
    flags[k++] = sp_dtype_name(cfg->param_dtype);
  }
  if (cfg->reduce_dtype) {
    flags[k++] = "reduce-dtype";
    flags[k++] = sp_dtype_name(cfg->reduce_dtype);
  }
  if (cfg->buffer_dtype) {
    flags[k++] = "buffer-dtype";
    flags[k++] = sp_dtype_name(cfg->buffer_dtype);
  }
  if (cfg->keep_low) {
    flags[k++] = "keep-low-precision-grads";
    flags[k++] = "1";
  }
  flags[k] = NULL;
  sp_coord_fixture_start(&h->fx, cfg->model, flags, 0);

  /* one rank, or shard groups of one: nothing is sharded, and the runtime
   * runs NO_SHARD */
  sp_strategy eff =
      cfg->world == 1 || (cfg->strategy == SP_HYBRID_SHARD && cfg->group == 1)
          ? SP_NO_SHARD
          : cfg->strategy;
  sp_dtype pdt = cfg->param_dtype ? cfg->param_dtype : SP_FLOAT32;
  h->job.world = cfg->world;
  h->job.run = rank_run;
  h->job.finish = rank_teardown;
  h->job.hold = true;
  for (uint32_t r = 0; r < cfg->world; r++) {
    rank_ctx *c = &h->ranks[r];
    c->h = h;
    c->strategy = eff;
    c->shard_world = eff == SP_NO_SHARD       ? 1
                     : eff == SP_HYBRID_SHARD ? cfg->group
                                              : cfg->world;
    c->pdt = pdt;
    c->gdt = cfg->keep_low ? pdt : SP_FLOAT32;
    h->job.rank[r] = &c->t;
  }
  sp_test_ranks_start(&h->job);
  bool failed = sp_test_ranks_wait(&h->job);
  char coord_err[512] = "";
  if (!failed) check_coordinator(h, coord_err, sizeof coord_err);
  char first[1024];
  sp_test_ranks_join(&h->job, first, sizeof first);
  sp_coord_fixture_stop(&h->fx);
  free(h);
  double dt = sp_clock_s() - t0;
  printf("  %s W=%u %s%s%s%s%s: %.2f s\n",
         strrchr(cfg->model, '/') ? strrchr(cfg->model, '/') + 1 : cfg->model,
         cfg->world, sp_strategy_name(eff), cfg->param_dtype ? " param " : "",
         cfg->param_dtype ? sp_dtype_name(cfg->param_dtype) : "",
         cfg->reduce_dtype ? " reduce float32" : "",
         cfg->keep_low ? " keep_low" : "", dt);
  if (first[0]) fail_msg("%s", first);
  if (coord_err[0]) fail_msg("coordinator: %s", coord_err);
}

/* ---- bodies ---- */

/* Two checked steps, then the exact collective counts of the schedule. */
static int body_two_steps(rank_ctx *c, void *arg) {
  (void)arg;
  for (uint64_t s = 0; s < 2; s++) {
    step_opts so = {.step = s + 1, .lr = LR};
    TRY(run_step(c, &so));
  }
  sp_fsdp_stats st;
  sp_fsdp_get_stats(c->f, &st);
  uint64_t n = n_units(c), steps = 2;
  uint64_t gathers, prefetches = 0, rs = 0, ar = 0;
  switch (c->strategy) {
    case SP_FULL_SHARD:
    case SP_HYBRID_SHARD:
      /* forward: every unit; backward: every unit but the root (kept) */
      gathers = (2 * n - 1) * steps;
      /* each unit prefetches the one before it in post-forward order */
      if (c->h->cfg.prefetch) prefetches = (n - 1) * steps;
      rs = n * steps;
      if (c->strategy == SP_HYBRID_SHARD) ar = n * steps;
      break;
    case SP_SHARD_GRAD_OP:
      gathers = n * steps; /* kept through backward, nothing to prefetch */
      rs = n * steps;
      break;
    default:
      /* casts after every SGD step; none when the unsharded parameter is
       * the master itself (no mixed precision) */
      gathers = c->pdt == SP_FLOAT32 ? 0 : n * steps;
      ar = n * steps;
  }
  CHECK(c, st.all_gathers == gathers, "all_gathers %llu, want %llu",
        (unsigned long long)st.all_gathers, (unsigned long long)gathers);
  CHECK(c, st.prefetches == prefetches, "prefetches %llu, want %llu",
        (unsigned long long)st.prefetches, (unsigned long long)prefetches);
  CHECK(c, st.reduce_scatters == rs, "reduce_scatters %llu, want %llu",
        (unsigned long long)st.reduce_scatters, (unsigned long long)rs);
  CHECK(c, st.all_reduces == ar, "all_reduces %llu, want %llu",
        (unsigned long long)st.all_reduces, (unsigned long long)ar);
  uint64_t limit = c->h->cfg.max_inflight ? c->h->cfg.max_inflight : 2;
  CHECK(c, st.max_inflight >= (gathers ? 1 : 0) && st.max_inflight <= limit,
        "max_inflight %llu, limit %llu", (unsigned long long)st.max_inflight,
        (unsigned long long)limit);
  /* the master after the last SGD, gathered */
  TRY(check_master(c, false));
  return 0;
}

static job_cfg cfg_of(const char *model, uint32_t w, sp_strategy s) {
  job_cfg cfg = {.model = model, .world = w, .strategy = s, .prefetch = true};
  return cfg;
}

static void test_full_shard_mlp_w1_to_w4(void **state) {
  (void)state;
  for (uint32_t w = 1; w <= 4; w++) {
    job_cfg cfg = cfg_of(MLP, w, SP_FULL_SHARD);
    run_job(&cfg, body_two_steps, NULL);
  }
}

static void test_strategies(void **state) {
  (void)state;
  job_cfg cfgs[] = {
      cfg_of(g_synth, 3, SP_FULL_SHARD),
      cfg_of(g_synth, 4, SP_FULL_SHARD),
      cfg_of(g_synth, 2, SP_SHARD_GRAD_OP),
      cfg_of(g_synth, 3, SP_SHARD_GRAD_OP),
      cfg_of(g_synth, 2, SP_NO_SHARD),
      cfg_of(g_synth, 3, SP_NO_SHARD),
      cfg_of(g_synth, 4, SP_HYBRID_SHARD),
      cfg_of(MLP, 2, SP_SHARD_GRAD_OP),
  };
  cfgs[6].group = 2;
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
    run_job(&cfgs[i], body_two_steps, NULL);
}

static void test_mixed_precision(void **state) {
  (void)state;
  job_cfg cfgs[7];
  cfgs[0] = cfg_of(g_synth, 3, SP_FULL_SHARD);
  cfgs[0].param_dtype = SP_BFLOAT16;
  cfgs[1] = cfg_of(g_synth, 4, SP_HYBRID_SHARD);
  cfgs[1].group = 2;
  cfgs[1].param_dtype = SP_BFLOAT16;
  /* reduce_dtype unlike param_dtype: the cast before the collective */
  cfgs[2] = cfg_of(g_synth, 4, SP_FULL_SHARD);
  cfgs[2].param_dtype = SP_BFLOAT16;
  cfgs[2].reduce_dtype = SP_FLOAT32;
  cfgs[3] = cfg_of(g_synth, 2, SP_FULL_SHARD);
  cfgs[3].param_dtype = SP_BFLOAT16;
  cfgs[3].keep_low = true;
  cfgs[4] = cfg_of(g_synth, 3, SP_SHARD_GRAD_OP);
  cfgs[4].param_dtype = SP_BFLOAT16;
  cfgs[4].keep_low = true;
  cfgs[5] = cfg_of(g_synth, 2, SP_NO_SHARD);
  cfgs[5].param_dtype = SP_BFLOAT16;
  cfgs[5].keep_low = true;
  cfgs[6] = cfg_of(MLP, 4, SP_FULL_SHARD);
  cfgs[6].param_dtype = SP_BFLOAT16;
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
    run_job(&cfgs[i], body_two_steps, NULL);
}

/* float16 gradients, the same on every rank: 30000 (even flat indices)
 * and 2^-23, two subnormal steps (odd). Their mean is themselves. Without
 * the pre-divide the W=3 or W=4 sum of 30000 overflows float16 (65504);
 * a pre-divide larger than FSDP's 2 rounds 2^-23 / 4 to zero; so only
 * factors (2, W/2) give the mean exactly. */
static double fp16_grad(const rank_ctx *c, uint32_t u, int64_t j) {
  (void)c;
  (void)u;
  return j % 2 ? ldexp(1.0, -23) : 30000.0;
}

static const grad_fn k_fp16_grads = {fp16_grad, fp16_grad};

static int body_fp16_divide(rank_ctx *c, void *arg) {
  (void)arg;
  step_opts so = {.step = 1, .lr = 0, .gf = &k_fp16_grads};
  return run_step(c, &so);
}

static void test_divide_factors_float16(void **state) {
  (void)state;
  for (uint32_t w = 3; w <= 4; w++) {
    job_cfg cfg = cfg_of(g_synth, w, SP_FULL_SHARD);
    cfg.param_dtype = SP_FLOAT16;
    run_job(&cfg, body_fp16_divide, NULL);
  }
}

/* reduce_dtype float32 under param_dtype bfloat16: rank 0 writes s, the
 * others s * 2^-8 (s = -1, 0, 1 by element), all exact in bfloat16. The
 * sum 1 + (W-1) 2^-8 needs 8 fraction bits: a bfloat16 collective (7)
 * would round it, a float32 one keeps it, so only a reduction in float32
 * gives the mean exactly. */
static double split_sign(int64_t j) { return (double)(j % 3 - 1); }

static double split_grad(const rank_ctx *c, uint32_t u, int64_t j) {
  (void)u;
  return split_sign(j) * (c->t.rank == 0 ? 1.0 : ldexp(1.0, -8));
}

static double split_grad_mean(const rank_ctx *c, uint32_t u, int64_t j) {
  (void)u;
  double w = c->h->cfg.world;
  return split_sign(j) * (1.0 + (w - 1) * ldexp(1.0, -8)) / w;
}

static const grad_fn k_split_grads = {split_grad, split_grad_mean};

static int body_reduce_dtype(rank_ctx *c, void *arg) {
  (void)arg;
  step_opts so = {.step = 1, .lr = LR, .gf = &k_split_grads};
  TRY(run_step(c, &so));
  return check_master(c, false);
}

static void test_reduce_dtype_float32(void **state) {
  (void)state;
  job_cfg cfg = cfg_of(g_synth, 4, SP_FULL_SHARD);
  cfg.param_dtype = SP_BFLOAT16;
  cfg.reduce_dtype = SP_FLOAT32;
  run_job(&cfg, body_reduce_dtype, NULL);
  cfg = cfg_of(g_synth, 4, SP_HYBRID_SHARD);
  cfg.group = 2;
  cfg.param_dtype = SP_BFLOAT16;
  cfg.reduce_dtype = SP_FLOAT32;
  run_job(&cfg, body_reduce_dtype, NULL);
  cfg = cfg_of(g_synth, 2, SP_NO_SHARD);
  cfg.param_dtype = SP_BFLOAT16;
  cfg.reduce_dtype = SP_FLOAT32;
  run_job(&cfg, body_reduce_dtype, NULL);
}

static void test_backward_prefetch(void **state) {
  (void)state;
  /* body_two_steps asserts prefetches == (units - 1) per step with
   * prefetch on, and 0 with it off or when nothing is resharded */
  job_cfg on = cfg_of(g_synth, 2, SP_FULL_SHARD);
  job_cfg off = on;
  off.prefetch = false;
  job_cfg limit1 = on;
  limit1.max_inflight = 1;
  job_cfg sgo = cfg_of(g_synth, 2, SP_SHARD_GRAD_OP);
  run_job(&on, body_two_steps, NULL);
  run_job(&off, body_two_steps, NULL);
  run_job(&limit1, body_two_steps, NULL);
  run_job(&sgo, body_two_steps, NULL);
}

/* The limiter. Rank 1 starts its backward late, so rank 0's prefetch of
 * the last unit (issued by root_pre_backward) cannot complete; rank 0 then
 * unshards a unit out of order, which needs a second all-gather. With
 * max_inflight_gathers 2 both are in flight at once; with 1, the second
 * waits for the first. */
static int body_limiter(rank_ctx *c, void *arg) {
  (void)arg;
  const uint32_t jump = 3;
  uint32_t nu = n_units(c);
  TRY(forward(c, true));
  if (c->t.rank == 1) sp_test_sleep_ms(200);
  SCHED(c, 2, sp_fsdp_root_pre_backward(c->f, &D));
  TRY(write_grads(c, 0, &k_rank_grads));
  for (uint32_t i = 0; i < nu - 1; i++) {
    uint32_t u = i == 0 ? jump : nu - i <= jump ? nu - i - 1 : nu - i;
    SCHED(c, 1, sp_fsdp_pre_backward(c->f, u, &D));
    TRY(check_views(c, u, "after pre_backward"));
    TRY(write_grads(c, u, &k_rank_grads));
    SCHED(c, 1, sp_fsdp_post_backward(c->f, u, &D));
  }
  SCHED(c, 1, sp_fsdp_post_backward(c->f, 0, &D));
  SCHED(c, nu + 1, sp_fsdp_finish_backward(c->f, &D));
  for (uint32_t u = 0; u < nu; u++) TRY(check_shard_grad(c, u, &k_rank_grads));
  sp_fsdp_stats st;
  sp_fsdp_get_stats(c->f, &st);
  uint64_t limit = c->h->cfg.max_inflight;
  /* every unit once in forward, every unit but the root once in backward:
   * a unit whose backward already ran is not prefetched again */
  CHECK(c, st.all_gathers == 2 * (uint64_t)nu - 1,
        "all_gathers %llu, want "
        "%llu",
        (unsigned long long)st.all_gathers,
        (unsigned long long)(2 * (uint64_t)nu - 1));
  CHECK(c, st.max_inflight <= limit, "max_inflight %llu over the limit %llu",
        (unsigned long long)st.max_inflight, (unsigned long long)limit);
  if (c->t.rank == 0)
    CHECK(c, st.max_inflight == limit,
          "rank 0 had at most %llu all-gathers in flight, the schedule "
          "wanted 2 and the limit is %llu",
          (unsigned long long)st.max_inflight, (unsigned long long)limit);
  /* the next step sees the updated parameters: no gather of this one is
   * left over */
  TRY(sgd(c, LR, 0, &k_rank_grads));
  step_opts so = {.step = 2, .lr = LR};
  return run_step(c, &so);
}

static void test_limiter(void **state) {
  (void)state;
  for (uint32_t limit = 1; limit <= 2; limit++) {
    job_cfg cfg = cfg_of(g_synth, 2, SP_FULL_SHARD);
    cfg.max_inflight = limit;
    run_job(&cfg, body_limiter, NULL);
  }
}

/* Illegal calls, made by every rank alike (so a collective issued by
 * mistake would not hang, only show): each is refused with SP_ESTATE (or
 * SP_ERANGE), names the unit and the legal states, changes nothing and
 * issues nothing; the schedule then goes on and gives exact results. */
static int body_illegal(rank_ctx *c, void *arg) {
  (void)arg;
  uint32_t nu = n_units(c), last = nu - 1;
  sp_fsdp *f = c->f;
  char u1[64], u2[64], ul[64], legal[96];
  snprintf(u1, sizeof u1, "unit 1 (%s)", sp_plan_unit_fqn(c->plan, 1));
  snprintf(u2, sizeof u2, "unit 2 (%s)", sp_plan_unit_fqn(c->plan, 2));
  snprintf(ul, sizeof ul, "unit %u (%s)", last,
           sp_plan_unit_fqn(c->plan, last));
  int32_t p_last = -1; /* a parameter of the last unit */
  for (size_t p = 0; p < c->model->n_params && p_last < 0; p++)
    if (param_in_unit(c, p, last)) p_last = (int32_t)p;
  CHECK(c, p_last >= 0, "no parameter in the last unit");

  /* before any forward */
  REFUSED(c, SP_ESTATE, u2, sp_fsdp_post_forward(f, 2, &D));
  REFUSED(c, SP_ESTATE, "FORWARD", sp_fsdp_post_forward(f, 2, &D));
  CHECK(c, sp_session_state(c->s, SP_MACHINE_HANDLE, 2) == SP_HANDLE_IDLE,
        "refused post_forward moved unit 2");
  REFUSED(c, SP_ESTATE, NULL, sp_fsdp_root_post_forward(f, &D));
  REFUSED(c, SP_ERANGE, "out of range", sp_fsdp_pre_forward(f, nu, &D));
  REFUSED(c, SP_ERANGE, "out of range", sp_fsdp_post_backward(f, nu + 5, &D));
  REFUSED(c, SP_ERANGE, NULL, sp_fsdp_gather_param(f, -1, NULL, &D));

  sp_session_set_step(c->s, 1);
  SCHED(c, 2, sp_fsdp_root_pre_forward(f, &D));
  REFUSED(c, SP_ESTATE, "FORWARD_BACKWARD", sp_fsdp_root_pre_forward(f, &D));
  /* a summon inside forward: refused before its collective */
  float one;
  REFUSED(c, SP_ESTATE, "legal", sp_fsdp_gather_param(f, p_last, &one, &D));
  SCHED(c, 1, sp_fsdp_pre_forward(f, 1, &D));
  /* the final callback in the middle of forward */
  REFUSED(c, SP_ESTATE, "during forward", sp_fsdp_finish_backward(f, &D));
  CHECK(c, sp_session_state(c->s, SP_MACHINE_HANDLE, 1) == SP_HANDLE_FORWARD,
        "a refused finish_backward moved unit 1");
  snprintf(legal, sizeof legal, "legal from FORWARD: IDLE");
  REFUSED(c, SP_ESTATE, u1, sp_fsdp_pre_forward(f, 1, &D));
  REFUSED(c, SP_ESTATE, legal, sp_fsdp_pre_forward(f, 1, &D));
  SCHED(c, 1, sp_fsdp_post_forward(f, 1, &D));
  REFUSED(c, SP_ESTATE, u1, sp_fsdp_post_forward(f, 1, &D));
  for (uint32_t u = 2; u < nu; u++) {
    SCHED(c, 1, sp_fsdp_pre_forward(f, u, &D));
    SCHED(c, 1, sp_fsdp_post_forward(f, u, &D));
  }
  SCHED(c, 2, sp_fsdp_root_post_forward(f, &D));

  /* a gradient reduction outside backward: nothing issued */
  sp_fsdp_stats s0, s1;
  sp_fsdp_get_stats(f, &s0);
  REFUSED(c, SP_ESTATE, "legal from IDLE", sp_fsdp_post_backward(f, 4, &D));
  sp_fsdp_get_stats(f, &s1);
  CHECK(c, s1.reduce_scatters == s0.reduce_scatters,
        "a refused post_backward issued a reduce-scatter");

  SCHED(c, 2, sp_fsdp_root_pre_backward(f, &D));
  TRY(write_grads(c, 0, &k_rank_grads));
  SCHED(c, 1, sp_fsdp_pre_backward(f, last, &D));
  REFUSED(c, SP_ESTATE, ul, sp_fsdp_pre_backward(f, last, &D));
  REFUSED(c, SP_ESTATE, "legal from BACKWARD_PRE: IDLE, BACKWARD_POST",
          sp_fsdp_pre_backward(f, last, &D));
  /* post_forward in backward: the table's BACKWARD_PRE -> IDLE belongs to
   * finish_backward, not to post_forward */
  REFUSED(c, SP_ESTATE, ul, sp_fsdp_post_forward(f, last, &D));
  CHECK(
      c,
      sp_session_state(c->s, SP_MACHINE_HANDLE, last) == SP_HANDLE_BACKWARD_PRE,
      "refused post_forward moved the last unit");
  TRY(check_views(c, last, "after a refused post_forward"));
  TRY(write_grads(c, last, &k_rank_grads));
  SCHED(c, 1, sp_fsdp_post_backward(f, last, &D));
  /* reentrant activation checkpointing runs the hook again: legal, and it
   * must not reduce (and divide) the gradient a second time */
  sp_fsdp_get_stats(f, &s0);
  SCHED(c, 1, sp_fsdp_post_backward(f, last, &D));
  sp_fsdp_get_stats(f, &s1);
  CHECK(c,
        s1.reduce_scatters == s0.reduce_scatters &&
            s1.all_reduces == s0.all_reduces,
        "a second post_backward reduced again");

  /* unsharding again after post_backward: refused before the all-gather */
  sp_fsdp_get_stats(f, &s0);
  REFUSED(c, SP_ESTATE, ul, sp_fsdp_pre_forward(f, last, &D));
  REFUSED(c, SP_ESTATE, "legal from BACKWARD_POST",
          sp_fsdp_pre_backward(f, last, &D));
  sp_fsdp_get_stats(f, &s1);
  CHECK(c, s1.all_gathers == s0.all_gathers,
        "refused calls issued %llu all-gathers",
        (unsigned long long)(s1.all_gathers - s0.all_gathers));
  if (is_sharded(c))
    CHECK(c, sp_fsdp_param(f, p_last) == NULL,
          "a refused call unsharded the last unit");

  for (uint32_t u = last; u-- > 1;) {
    SCHED(c, 1, sp_fsdp_pre_backward(f, u, &D));
    TRY(write_grads(c, u, &k_rank_grads));
    SCHED(c, 1, sp_fsdp_post_backward(f, u, &D));
  }
  SCHED(c, 1, sp_fsdp_post_backward(f, 0, &D));
  SCHED(c, nu + 1, sp_fsdp_finish_backward(f, &D));
  REFUSED(c, SP_ESTATE, NULL, sp_fsdp_root_post_forward(f, &D));
  /* the refused calls changed no gradient */
  for (uint32_t u = 0; u < nu; u++) TRY(check_shard_grad(c, u, &k_rank_grads));
  TRY(sgd(c, LR, 0, &k_rank_grads));
  /* and the runtime goes on as if they had not been made */
  step_opts so = {.step = 2, .lr = LR};
  TRY(run_step(c, &so));
  return check_master(c, false);
}

static void test_illegal_schedules(void **state) {
  (void)state;
  job_cfg cfg = cfg_of(g_synth, 2, SP_FULL_SHARD);
  run_job(&cfg, body_illegal, NULL);
  cfg.strategy = SP_NO_SHARD;
  run_job(&cfg, body_illegal, NULL);
}

/* A unit whose backward does not run (its outputs needed no gradient; the
 * handle goes IDLE -> IDLE at finish_backward) after the next unit's
 * pre_backward prefetched it. Its gathered parameters belong to that step:
 * the next forward must gather the updated master, not reuse them. */
static int body_skipped_backward(rank_ctx *c, void *arg) {
  (void)arg;
  step_opts s1 = {.step = 1, .lr = LR};
  step_opts s2 = {.step = 2, .lr = LR, .skip = 1};
  step_opts s3 = {.step = 3, .lr = LR, .resync = true};
  TRY(run_step(c, &s1));
  TRY(run_step(c, &s2));
  TRY(run_step(c, &s3));
  sp_fsdp_stats st;
  sp_fsdp_get_stats(c->f, &st);
  uint64_t nu = n_units(c);
  CHECK(c, st.all_gathers == 3 * (2 * nu - 1), "all_gathers %llu, want %llu",
        (unsigned long long)st.all_gathers,
        (unsigned long long)(3 * (2 * nu - 1)));
  return 0;
}

static void test_prefetched_unit_skipped_in_backward(void **state) {
  (void)state;
  job_cfg cfg = cfg_of(g_synth, 2, SP_FULL_SHARD);
  run_job(&cfg, body_skipped_backward, NULL);
  cfg = cfg_of(g_synth, 4, SP_HYBRID_SHARD);
  cfg.group = 2;
  run_job(&cfg, body_skipped_backward, NULL);
}

/* Lazy init: before the first root_pre_forward every buffer is in its
 * original dtype; after it, floating buffers are in buffer_dtype with their
 * values cast, integer and bool buffers untouched; later forwards cast
 * nothing again. */
static double buf_value(size_t b, size_t i) {
  return (double)((int)((b * 5 + i) % 9) - 4) * 0.25; /* exact everywhere */
}

static int body_lazy_init(rank_ctx *c, void *arg) {
  (void)arg;
  const sp_model *m = c->model;
  sp_fsdp *f = c->f;
  size_t nb = m->n_buffers;
  CHECK(c, nb == c->plan->n_buffers && nb > 0, "buffers");
  void **ptr = calloc(nb, sizeof *ptr);
  CHECK(c, ptr != NULL, "no memory");
  int floating = 0;
  for (size_t b = 0; b < nb; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    size_t n = (size_t)t->numel;
    CHECK(c, sp_fsdp_buffer_dtype(f, (int32_t)b) == t->dtype,
          "%s is %s before the first forward, want %s", t->fqn,
          sp_dtype_name(sp_fsdp_buffer_dtype(f, (int32_t)b)),
          sp_dtype_name(t->dtype));
    void *p = sp_fsdp_buffer(f, (int32_t)b);
    CHECK(c, p != NULL, "%s has no storage", t->fqn);
    if (sp_dtype_is_floating(t->dtype)) {
      floating++;
      double *v = malloc(n * sizeof *v);
      CHECK(c, v != NULL, "no memory");
      for (size_t i = 0; i < n; i++) v[i] = buf_value(b, i);
      sp_cast(p, t->dtype, v, SP_FLOAT64, n);
      free(v);
    } else {
      /* integers and bools: a marker byte pattern that must survive */
      memset(p, 0x01, n * sp_dtype_size(t->dtype));
    }
  }
  CHECK(c, floating >= 3, "the spec should have floating buffers");

  sp_session_set_step(c->s, 1);
  SCHED(c, 2, sp_fsdp_root_pre_forward(f, &D));
  for (size_t b = 0; b < nb; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    size_t n = (size_t)t->numel;
    bool fl = sp_dtype_is_floating(t->dtype);
    sp_dtype want = fl ? c->h->cfg.buffer_dtype : t->dtype;
    sp_dtype got = sp_fsdp_buffer_dtype(f, (int32_t)b);
    CHECK(c, got == want, "%s is %s after lazy init, want %s", t->fqn,
          sp_dtype_name(got), sp_dtype_name(want));
    CHECK(c, c->plan->buffers[b].compute_dtype == want,
          "%s: the plan says compute dtype %s", t->fqn,
          sp_dtype_name(c->plan->buffers[b].compute_dtype));
    void *p = sp_fsdp_buffer(f, (int32_t)b);
    CHECK(c, p != NULL, "%s has no storage", t->fqn);
    ptr[b] = p;
    if (fl) {
      double *v = malloc(n * sizeof *v);
      CHECK(c, v != NULL, "no memory");
      sp_cast(v, SP_FLOAT64, p, got, n);
      size_t bad = n;
      for (size_t i = 0; i < n && bad == n; i++)
        if (v[i] != buf_value(b, i)) bad = i;
      /* overwrite with a value a second cast would not keep the same way:
       * the next forward must leave it alone */
      for (size_t i = 0; i < n; i++) v[i] = buf_value(b, i) + 1.0;
      sp_cast(p, got, v, SP_FLOAT64, n);
      free(v);
      CHECK(c, bad == n, "%s[%zu] lost its value in the cast", t->fqn, bad);
    } else {
      const uint8_t *q = p;
      for (size_t i = 0; i < n * sp_dtype_size(t->dtype); i++)
        CHECK(c, q[i] == 0x01, "%s changed at lazy init", t->fqn);
    }
  }
  for (uint32_t u = 1; u < n_units(c); u++) {
    SCHED(c, 1, sp_fsdp_pre_forward(f, u, &D));
    SCHED(c, 1, sp_fsdp_post_forward(f, u, &D));
  }
  SCHED(c, 2, sp_fsdp_root_post_forward(f, &D));
  TRY(backward(c, false, 0, &k_rank_grads));
  TRY(sgd(c, LR, 0, &k_rank_grads));

  /* a second step: no cast, same storage, the values written stay */
  sp_session_set_step(c->s, 2);
  TRY(forward(c, true));
  for (size_t b = 0; b < nb; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    bool fl = sp_dtype_is_floating(t->dtype);
    CHECK(c, sp_fsdp_buffer(f, (int32_t)b) == ptr[b],
          "%s was reallocated by a later forward", t->fqn);
    CHECK(c,
          sp_fsdp_buffer_dtype(f, (int32_t)b) ==
              (fl ? c->h->cfg.buffer_dtype : t->dtype),
          "%s changed dtype", t->fqn);
    if (fl) {
      double v0;
      sp_cast(&v0, SP_FLOAT64, ptr[b], c->h->cfg.buffer_dtype, 1);
      CHECK(c, v0 == buf_value(b, 0) + 1.0, "%s was recast", t->fqn);
    }
  }
  free(ptr);
  TRY(backward(c, true, 0, &k_rank_grads));
  return 0;
}

static void test_lazy_init_buffers(void **state) {
  (void)state;
  job_cfg cfg = cfg_of(MLP_BUFFERS, 2, SP_FULL_SHARD);
  cfg.buffer_dtype = SP_BFLOAT16;
  run_job(&cfg, body_lazy_init, NULL);
  cfg.buffer_dtype = SP_FLOAT32; /* float64, float16, bfloat16 all move */
  run_job(&cfg, body_lazy_init, NULL);
}

/* ---- memory: the model predicts the runtime's counters exactly ---- */

/* Two steps of the standard schedule (no summons: a checkpoint's gather
 * is no part of a step), then every counter of sp_fsdp_stats.mem equals
 * what sp_mem_estimate_plan predicts for the plan: each category's peak
 * and current bytes, in use and reserved, and the allocator calls, which
 * the second step must not add to. */
static int body_memory(rank_ctx *c, void *arg) {
  (void)arg;
  uint64_t allocs_step1 = 0;
  for (uint64_t s = 1; s <= 2; s++) {
    sp_session_set_step(c->s, s);
    TRY(forward(c, false));
    TRY(backward(c, false, 0, &k_rank_grads));
    TRY(sgd(c, LR, 0, &k_rank_grads));
    sp_fsdp_stats st;
    sp_fsdp_get_stats(c->f, &st);
    if (s == 1) allocs_step1 = st.mem.allocs;
  }
  sp_fsdp_stats st;
  sp_fsdp_get_stats(c->f, &st);
  sp_mem_opts o;
  sp_mem_opts_default(&o);
  o.backward_prefetch = c->h->cfg.prefetch;
  o.max_inflight = c->h->cfg.max_inflight;
  sp_mem_estimate e;
  CALL(c, sp_mem_estimate_plan(c->plan, &o, &e, &D));
  const sp_mem_account *got = &st.mem, *want = &e.acct;
  for (int k = 0; k < SP_MEM_N_CATS; k++) {
    const char *name = sp_mem_cat_label((sp_mem_cat)k);
    CHECK(c, got->cat[k].peak == want->cat[k].peak,
          "%s: peak %llu bytes, the model says %llu", name,
          (unsigned long long)got->cat[k].peak,
          (unsigned long long)want->cat[k].peak);
    CHECK(c, got->cat[k].current == want->cat[k].current,
          "%s: %llu bytes after two steps, the model says %llu", name,
          (unsigned long long)got->cat[k].current,
          (unsigned long long)want->cat[k].current);
  }
  CHECK(c, got->total.peak == want->total.peak,
        "total peak %llu bytes, the model says %llu",
        (unsigned long long)got->total.peak,
        (unsigned long long)want->total.peak);
  CHECK(c,
        got->reserved.peak == want->reserved.peak &&
            got->reserved.current == want->reserved.current,
        "reserved %llu bytes (peak %llu), the model says %llu (%llu)",
        (unsigned long long)got->reserved.current,
        (unsigned long long)got->reserved.peak,
        (unsigned long long)want->reserved.current,
        (unsigned long long)want->reserved.peak);
  CHECK(c, got->allocs == want->allocs,
        "%llu allocations, the model says "
        "%llu",
        (unsigned long long)got->allocs, (unsigned long long)want->allocs);
  CHECK(c, got->allocs == allocs_step1,
        "the second step allocated %llu "
        "blocks",
        (unsigned long long)(got->allocs - allocs_step1));
  /* and the pool held the unsharded state only in flight: after the
   * steps, only NO_SHARD keeps any */
  if (is_sharded(c))
    CHECK(c,
          got->cat[SP_MEM_PARAMS].current == 0 &&
              got->cat[SP_MEM_GRADS].current == 0 &&
              got->cat[SP_MEM_REDUCE].current == 0,
          "unsharded storage still in use after the steps: params %llu, "
          "grads %llu, reduce %llu",
          (unsigned long long)got->cat[SP_MEM_PARAMS].current,
          (unsigned long long)got->cat[SP_MEM_GRADS].current,
          (unsigned long long)got->cat[SP_MEM_REDUCE].current);
  return 0;
}

static job_cfg cfg_hybrid(const char *model, uint32_t w, uint32_t g) {
  job_cfg cfg = cfg_of(model, w, SP_HYBRID_SHARD);
  cfg.group = g;
  return cfg;
}

/* The reference MLP on every strategy at W = 1..4 (W = 1 is NO_SHARD
 * whatever is asked), then mixed precision (a reduce dtype of its own
 * needs red_in; keep_low_precision_grads changes the gradient shards),
 * buffers that lazy init casts, and the limiter and prefetch options on the
 * synthetic spec. */
static void test_memory_model_exact(void **state) {
  (void)state;
  job_cfg cfgs[32];
  size_t n = 0;
  cfgs[n++] = cfg_of(MLP, 1, SP_FULL_SHARD);
  for (uint32_t w = 2; w <= 4; w++) {
    cfgs[n++] = cfg_of(MLP, w, SP_FULL_SHARD);
    cfgs[n++] = cfg_of(MLP, w, SP_SHARD_GRAD_OP);
    cfgs[n++] = cfg_of(MLP, w, SP_NO_SHARD);
    cfgs[n++] = cfg_hybrid(MLP, w, w % 2 == 0 ? 2 : 1);
  }
  cfgs[n] = cfg_of(MLP, 4, SP_FULL_SHARD);
  cfgs[n++].param_dtype = SP_BFLOAT16;
  cfgs[n] = cfg_hybrid(MLP, 4, 2);
  cfgs[n].param_dtype = SP_BFLOAT16;
  cfgs[n++].reduce_dtype = SP_FLOAT32;
  cfgs[n] = cfg_of(MLP, 3, SP_SHARD_GRAD_OP);
  cfgs[n].param_dtype = SP_BFLOAT16;
  cfgs[n++].keep_low = true;
  cfgs[n] = cfg_of(MLP, 2, SP_NO_SHARD);
  cfgs[n].param_dtype = SP_BFLOAT16;
  cfgs[n++].reduce_dtype = SP_FLOAT32;
  cfgs[n] = cfg_of(MLP_BUFFERS, 2, SP_FULL_SHARD);
  cfgs[n++].buffer_dtype = SP_BFLOAT16;
  cfgs[n] = cfg_of(g_synth, 3, SP_FULL_SHARD);
  cfgs[n++].max_inflight = 1;
  cfgs[n] = cfg_of(g_synth, 4, SP_FULL_SHARD);
  cfgs[n++].prefetch = false;
  for (size_t i = 0; i < n; i++) run_job(&cfgs[i], body_memory, NULL);
}

/* ---- nothing sharded: one copy of each (docs/fsdp.md, "Memory") ----
 * With one rank, under NO_SHARD, and with HYBRID_SHARD's shard groups of
 * one rank, a float32 unit's unsharded parameter is its master and its
 * unsharded gradient its gradient shard, as FSDP's NO_SHARD flat
 * parameter and its .grad: every view points into the shards, and the
 * runtime's counted peak over two AdamW steps is the parameters, their
 * gradients, the two moments and the buffers, each once. Before, the
 * unsharded parameters and gradients were copies besides the shards
 * (GPT-2 at W = 1: 1.87 GiB with SGD where PyTorch holds 0.94). */

/* Every parameter's view and gradient buffer are its place in the unit's
 * master shard and gradient shard. */
static int check_views_are_shards(rank_ctx *c, const char *when) {
  const sp_model *m = c->model;
  for (size_t p = 0; p < m->n_params; p++) {
    uint32_t u = (uint32_t)c->plan->param_unit[p];
    int64_t n = 0;
    uint8_t *sh = sp_fsdp_shard(c->f, u, &n);
    uint8_t *sg = sp_fsdp_shard_grad(c->f, u);
    size_t off = (size_t)param_offset(c, (int32_t)p) * sizeof(float);
    CHECK(c, n == unit_numel(c, u), "%s: unit %u shard of %lld elements", when,
          u, (long long)n);
    CHECK(c, (uint8_t *)sp_fsdp_param(c->f, (int32_t)p) == sh + off,
          "%s: the view of %s is not its master", when, m->params[p].fqn);
    CHECK(c, (uint8_t *)sp_fsdp_param_grad(c->f, (int32_t)p) == sg + off,
          "%s: the gradient buffer of %s is not its gradient shard", when,
          m->params[p].fqn);
  }
  return 0;
}

static int body_flat_storage(rank_ctx *c, void *arg) {
  (void)arg;
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  CALL(c, sp_fsdp_optim_init(c->f, &o, &D));
  for (uint64_t s = 1; s <= 2; s++) {
    sp_session_set_step(c->s, s);
    /* the first forward's views hold the initial parameters */
    TRY(forward(c, s == 1));
    TRY(check_views_are_shards(c, "after forward"));
    /* the reduced gradient is in the shard the trainer wrote to */
    TRY(backward(c, false, 0, &k_rank_grads));
    TRY(check_views_are_shards(c, "after backward"));
    CALL(c, sp_fsdp_optim_step(c->f, NULL, &D));
  }
  uint64_t params = 0, buffers = 0;
  for (uint32_t u = 0; u < n_units(c); u++)
    params += (uint64_t)unit_numel(c, u) * sizeof(float);
  for (size_t b = 0; b < c->model->n_buffers; b++)
    buffers += (uint64_t)c->model->buffers[b].numel *
               sp_dtype_size(c->model->buffers[b].dtype);
  /* parameters, gradients, exp_avg, exp_avg_sq */
  uint64_t want = 4 * params + buffers;
  sp_fsdp_stats st;
  sp_fsdp_get_stats(c->f, &st);
  CHECK(c, st.mem.total.peak == want && st.mem.reserved.peak == want,
        "peak %llu bytes in use, %llu reserved; the parameters, gradients, "
        "moments and buffers are %llu",
        (unsigned long long)st.mem.total.peak,
        (unsigned long long)st.mem.reserved.peak, (unsigned long long)want);
  CHECK(c,
        st.mem.cat[SP_MEM_PARAMS].peak == 0 &&
            st.mem.cat[SP_MEM_GRADS].peak == 0 &&
            st.mem.cat[SP_MEM_REDUCE].peak == 0,
        "unsharded storage besides the shards: params %llu, grads %llu, "
        "reduce %llu",
        (unsigned long long)st.mem.cat[SP_MEM_PARAMS].peak,
        (unsigned long long)st.mem.cat[SP_MEM_GRADS].peak,
        (unsigned long long)st.mem.cat[SP_MEM_REDUCE].peak);
  /* nothing to copy in: no unshard is issued */
  CHECK(c, st.all_gathers == 0, "%llu unshards issued",
        (unsigned long long)st.all_gathers);
  if (c->t.rank == 0)
    printf("    peak %llu bytes: %llu of parameters, each held once\n",
           (unsigned long long)st.mem.total.peak, (unsigned long long)params);
  return 0;
}

static void test_flat_one_copy(void **state) {
  (void)state;
  job_cfg cfgs[] = {cfg_of(MLP, 1, SP_FULL_SHARD), cfg_of(MLP, 2, SP_NO_SHARD),
                    cfg_hybrid(MLP, 2, 1), cfg_of(g_synth, 3, SP_NO_SHARD)};
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
    run_job(&cfgs[i], body_flat_storage, NULL);
}

/* ---- the synthetic spec ---- */

static void append(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void append(char *buf, size_t cap, const char *fmt, ...) {
  size_t n = strlen(buf);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, cap - n, fmt, ap);
  va_end(ap);
}

/* Root "Net" with a parameter of its own (norm.weight, norm.bias: 18),
 * layers.0-5 Linear [5+i, 6] with bias (N = 35, 42, ..., 70: padding for
 * every W), layers.6 Linear [1, 1] without bias (N = 1 < W). */
static int setup(void **state) {
  (void)state;
  static char spec[8192];
  spec[0] = '\0';
  size_t cap = sizeof spec;
  append(spec, cap,
         "{\"format\": \"shardplane.model/v1\", \"name\": "
         "\"synthetic\",\n \"modules\": [{\"fqn\": \"\", \"type\": "
         "\"Net\"}, {\"fqn\": \"layers\", \"type\": "
         "\"Sequential\"}");
  for (int i = 0; i <= 6; i++)
    append(spec, cap, ", {\"fqn\": \"layers.%d\", \"type\": \"Linear\"}", i);
  append(spec, cap,
         ", {\"fqn\": \"norm\", \"type\": \"Norm\"}],\n "
         "\"params\": [");
  for (int i = 0; i < 6; i++)
    append(spec, cap,
           "{\"fqn\": \"layers.%d.weight\", \"shape\": [%d, 6], \"dtype\": "
           "\"float32\", \"requires_grad\": true},\n  {\"fqn\": "
           "\"layers.%d.bias\", \"shape\": [%d], \"dtype\": \"float32\", "
           "\"requires_grad\": true},\n  ",
           i, 5 + i, i, 5 + i);
  append(spec, cap,
         "{\"fqn\": \"layers.6.weight\", \"shape\": [1, 1], \"dtype\": "
         "\"float32\", \"requires_grad\": true},\n  {\"fqn\": \"norm.weight\", "
         "\"shape\": [9], \"dtype\": \"float32\", \"requires_grad\": true},\n"
         "  {\"fqn\": \"norm.bias\", \"shape\": [9], \"dtype\": \"float32\", "
         "\"requires_grad\": true}],\n \"buffers\": []}\n");
  assert_true(strlen(spec) < cap - 1);
  g_dir = sp_test_mkdtemp();
  g_synth = sp_test_path(g_dir, "synthetic.json");
  sp_test_write_file(g_synth, spec, strlen(spec));
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sp_test_rmtree(g_dir);
  free(g_dir);
  free(g_synth);
  return 0;
}

int main(int argc, char **argv) {
  /* one test by name: test_fsdp test_limiter */
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_full_shard_mlp_w1_to_w4),
      cmocka_unit_test(test_strategies),
      cmocka_unit_test(test_mixed_precision),
      cmocka_unit_test(test_divide_factors_float16),
      cmocka_unit_test(test_reduce_dtype_float32),
      cmocka_unit_test(test_backward_prefetch),
      cmocka_unit_test(test_limiter),
      cmocka_unit_test(test_illegal_schedules),
      cmocka_unit_test(test_prefetched_unit_skipped_in_backward),
      cmocka_unit_test(test_lazy_init_buffers),
      cmocka_unit_test(test_memory_model_exact),
      cmocka_unit_test(test_flat_one_copy),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
