/* The memory model and the caching pool (common/plan/memory.c) on cases
 * computed by hand from the rules of docs/fsdp.md ("Memory"), written out
 * event by event below, not derived from the model's code:
 *  - the reference MLP (examples/mlp.json, every Linear a unit) at W = 4
 *    under FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (groups of
 *    2) and FULL_SHARD with bfloat16 parameters: every category's peak,
 *    the total, the pool's reserved bytes and the allocations;
 *  - the same at W = 1, where every strategy is NO_SHARD, and with
 *    HYBRID_SHARD's shard groups of one rank: parameters and gradients
 *    held once each, the unsharded ones being the shards themselves;
 *  - GPT-2 (examples/models/gpt2.json, wrap GPT2Block: a root of 39.4 M
 *    elements and 12 equal blocks of 7.1 M) at W = 8 on every strategy in
 *    float32 and bfloat16, with AdamW and with no_sync, and NO_SHARD at
 *    W = 1;
 *  - the pool: exact-size reuse, peaks, release errors, size overflow;
 *  - options: names, bad values refused naming the field.
 * That the runtime's own counters equal the model's prediction is checked
 * by test_memory_model_exact (test_fsdp.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/job.h"
#include "plan/memory.h"
#include "plan/model.h"
#include "plan/plan.h"

#define MLP SP_EXAMPLES "/mlp.json"
#define GPT2 SP_EXAMPLES "/models/gpt2.json"

typedef struct built {
  sp_model *m;
  sp_plan *pl;
} built;

/* A plan of `model` for flags "name", "value", ..., NULL. */
static built build(const char *model, ...) {
  built b = {NULL, NULL};
  sp_diag d = {""};
  if (sp_model_load_file(model, &b.m, &d) != 0) fail_msg("%s", d.msg);
  sp_job job;
  sp_job_init(&job);
  va_list ap;
  va_start(ap, model);
  for (const char *k = va_arg(ap, const char *); k != NULL;
       k = va_arg(ap, const char *)) {
    const char *v = va_arg(ap, const char *);
    if (sp_job_apply_flag(&job, k, v, &d) != 0) fail_msg("%s", d.msg);
  }
  va_end(ap);
  if (sp_plan_build(b.m, &job, &b.pl, &d) != 0) fail_msg("%s", d.msg);
  sp_job_clear(&job);
  return b;
}

static void unbuild(built *b) {
  sp_plan_free(b->pl);
  sp_model_free(b->m);
}

static sp_mem_estimate estimate(const built *b, const sp_mem_opts *o) {
  sp_mem_estimate e;
  sp_diag d = {""};
  if (sp_mem_estimate_plan(b->pl, o, &e, &d) != 0) fail_msg("%s", d.msg);
  return e;
}

/* What a case expects: peaks by category, total peak, reserved peak and
 * allocator calls; current bytes after the steps are checked separately
 * where they matter. */
typedef struct want {
  uint64_t peak[SP_MEM_N_CATS];
  uint64_t total, reserved, allocs;
} want;

static void expect(const sp_mem_estimate *e, const want *w, const char *what) {
  for (int k = 0; k < SP_MEM_N_CATS; k++)
    if (e->acct.cat[k].peak != w->peak[k])
      fail_msg("%s: %s peak %llu, want %llu", what,
               sp_mem_cat_label((sp_mem_cat)k),
               (unsigned long long)e->acct.cat[k].peak,
               (unsigned long long)w->peak[k]);
  if (e->acct.total.peak != w->total)
    fail_msg("%s: total peak %llu, want %llu", what,
             (unsigned long long)e->acct.total.peak,
             (unsigned long long)w->total);
  if (w->reserved && e->acct.reserved.peak != w->reserved)
    fail_msg("%s: reserved %llu, want %llu", what,
             (unsigned long long)e->acct.reserved.peak,
             (unsigned long long)w->reserved);
  if (w->allocs && e->acct.allocs != w->allocs)
    fail_msg("%s: %llu allocations, want %llu", what,
             (unsigned long long)e->acct.allocs, (unsigned long long)w->allocs);
}

#define SHP SP_MEM_SHARD_PARAMS
#define SHG SP_MEM_SHARD_GRADS
#define OPT SP_MEM_OPTIMIZER
#define PAR SP_MEM_PARAMS
#define GRD SP_MEM_GRADS
#define RED SP_MEM_REDUCE
#define BUF SP_MEM_BUFFERS

/* ---- the reference MLP at W = 4 ----
 * Units in module order: 0 root (the two RunningNorm layers, N = 256),
 * 1 layers.0 (2112), 2 layers.3 (4160), 3 layers.6 (1040); the post-forward
 * order is 1, 2, 3, 0 and the backward runs 0 (root_pre_backward), 3, 2, 1,
 * then post_backward(0). Buffers: step, two num_batches_tracked (int64,
 * 8 bytes each) and two running means (64 float32): 536 bytes. SGD keeps
 * no state. Limiter 2, prefetch on. */

#define MLP_BUFFERS 536u

static void test_mlp_full_shard(void **state) {
  (void)state;
  built b = build(MLP, "world-size", "4", "wrap-type", "Linear", NULL);
  /* c = 64, 528, 1040, 260; slots (c * 4 elements, 4 bytes) P0..P3 =
   * 1024, 8448, 16640, 4160 (gradient slots G the same); reduce outputs
   * (c float32) R0..R3 = 256, 2112, 4160, 1040. Sharded state:
   * 2 * 4 * 1892 = 15136, persistent 15136 + 536 = 15672.
   *   forward        P0 + P2 at most                       params 17664
   *   pre_bw(0)      G0; prefetch 3: P0 + P3
   *   pre_bw(3)      G0 + G3; prefetch 2: P0 + P3 + P2 = 21824
   *   post_bw(3)     R3; reshard 3: P0 + P2
   *   pre_bw(2)      one reduction in flight: G0 + G3 + G2 = 21824;
   *                  prefetch 1: P0 + P2 + P1 = 26112       params peak
   *   post_bw(2)     R3 + R2 = 5200: total 15672 + 26112 + 21824 + 5200
   *                  = 68808                                total peak
   *                  reshard 2: P0 + P1 = 9472
   *   pre_bw(1)      two in flight: retire 3 (G3, R3); G0 + G2 + G1 =
   *                  26112                                   grads peak
   *   post_bw(1)     R2 + R1 = 6272                          reduce peak
   *   post_bw(0)     retire 2; R1 + R0; every slot back at finish.
   * Reserved: two blocks of each slot size (param and gradient of one
   * unit are live together; 4160 serves P3, G3 and R2, never three at
   * once), one each of 2112, 1040, 256: 2 * (1024 + 8448 + 16640 + 4160)
   * + 2112 + 1040 + 256 = 63952, plus 15672 persistent = 79624. Allocator
   * calls: 2 per unit + 5 buffers + 11 pool blocks = 24. */
  sp_mem_estimate e = estimate(&b, NULL);
  want w = {.peak = {[SHP] = 7568,
                     [SHG] = 7568,
                     [PAR] = 26112,
                     [GRD] = 26112,
                     [RED] = 6272,
                     [BUF] = MLP_BUFFERS},
            .total = 68808,
            .reserved = 79624,
            .allocs = 24};
  expect(&e, &w, "MLP FULL_SHARD W=4");
  /* after the steps only the sharded state is in use */
  assert_int_equal(e.acct.total.current, 15672);
  assert_int_equal(e.acct.reserved.current, 79624);
  assert_int_equal(e.sharded_state, 15136);
  /* floor: buffers + root P0 + G0 + 2 * the widest other unit (layers.3:
   * P2 + G2 + R2 = 37440) = 536 + 2048 + 74880 */
  assert_int_equal(e.in_flight_floor, 77464);
  unbuild(&b);
}

static void test_mlp_shard_grad_op(void **state) {
  (void)state;
  built b = build(MLP, "world-size", "4", "wrap-type", "Linear", "strategy",
                  "SHARD_GRAD_OP", NULL);
  /* the same sizes; every unit stays unsharded from its forward to its
   * post_backward, so nothing is prefetched:
   *   end of forward  P0 + P1 + P2 + P3 = 30272               params peak
   *   backward        as FULL_SHARD without the prefetches: the total
   *                   peaks at post_bw(2) with P0 + P1 + P2 (26112, unit 3
   *                   resharded), G0 + G3 + G2, R3 + R2: 68808 again;
   *                   grads 26112 and reduce 6272 as before.
   * Reserved: the same blocks: P1 and G1 are live together at pre_bw(1),
   * P2 and G2 at pre_bw(2): 79624. */
  sp_mem_estimate e = estimate(&b, NULL);
  want w = {.peak = {[SHP] = 7568,
                     [SHG] = 7568,
                     [PAR] = 30272,
                     [GRD] = 26112,
                     [RED] = 6272,
                     [BUF] = MLP_BUFFERS},
            .total = 68808,
            .reserved = 79624,
            .allocs = 24};
  expect(&e, &w, "MLP SHARD_GRAD_OP W=4");
  unbuild(&b);
}

/* c = N: the shard is the whole flat parameter, which is the unsharded
 * parameter itself, and the gradient shard the unsharded gradient (FSDP's
 * NO_SHARD flat parameter and its .grad); the all-reduce runs in place, so
 * no reduce buffer. Everything from sp_fsdp_new on: 2 * 4 * 7568 = 60544
 * + 536 = 61080; 2 blocks per unit + 5 buffers = 13. Before, the
 * unsharded parameters and gradients were copies: 121624. */
static const want k_mlp_flat = {.peak = {[SHP] = 30272,
                                         [SHG] = 30272,
                                         [PAR] = 0,
                                         [GRD] = 0,
                                         [RED] = 0,
                                         [BUF] = MLP_BUFFERS},
                                .total = 61080,
                                .reserved = 61080,
                                .allocs = 13};

static void test_mlp_no_shard(void **state) {
  (void)state;
  built b = build(MLP, "world-size", "4", "wrap-type", "Linear", "strategy",
                  "NO_SHARD", NULL);
  sp_mem_estimate e = estimate(&b, NULL);
  expect(&e, &k_mlp_flat, "MLP NO_SHARD W=4");
  assert_int_equal(e.acct.total.current, 61080);
  /* nothing is in flight: the root's and the layers' slots are their
   * shards */
  assert_int_equal(e.in_flight_floor, MLP_BUFFERS);
  unbuild(&b);
}

/* One rank (every strategy is NO_SHARD), and HYBRID_SHARD with shard
 * groups of one rank, which shards over nobody: the same as NO_SHARD,
 * parameters and gradients once each. */
static void test_mlp_flat(void **state) {
  (void)state;
  const char *strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  for (int i = 0; i < 3; i++) {
    built b = build(MLP, "world-size", "1", "wrap-type", "Linear", "strategy",
                    strategies[i], NULL);
    sp_mem_estimate e = estimate(&b, NULL);
    expect(&e, &k_mlp_flat, strategies[i]);
    /* AdamW adds its two moments, once each too */
    sp_mem_opts o;
    sp_mem_opts_default(&o);
    o.optimizer = SP_MEM_OPT_ADAMW;
    e = estimate(&b, &o);
    assert_int_equal(e.acct.total.peak, 61080 + 2 * 30272);
    unbuild(&b);
  }
  built b = build(MLP, "world-size", "4", "wrap-type", "Linear", "strategy",
                  "HYBRID_SHARD", "shard-group-size", "1", NULL);
  sp_mem_estimate e = estimate(&b, NULL);
  expect(&e, &k_mlp_flat, "MLP HYBRID_SHARD W=4 g=1");
  unbuild(&b);
}

static void test_mlp_hybrid(void **state) {
  (void)state;
  built b = build(MLP, "world-size", "4", "wrap-type", "Linear", "strategy",
                  "HYBRID_SHARD", "shard-group-size", "2", NULL);
  /* split over groups of 2: c = 128, 1056, 2080, 520; the slots are as at
   * W = 4 (c * 2 = the same padded sizes: 1024, 8448, 16640, 4160), the
   * reduce outputs twice as large: 512, 4224, 8320, 2080. Sharded state
   * 2 * 4 * 3784 = 30272, persistent 30808. The schedule is FULL_SHARD's:
   *   post_bw(2)  params 26112, grads 21824, reduce R3 + R2 = 10400:
   *               30808 + 58336 = 89144                     total peak
   *   post_bw(1)  reduce R2 + R1 = 12544                    reduce peak
   * Reserved: 2 * (1024 + 8448 + 16640 + 4160) + 512 + 4224 + 8320 + 2080
   * = 75680 (no reduce output shares a slot's size: 12 pool blocks,
   * 25 allocations), + 30808 = 106488. */
  sp_mem_estimate e = estimate(&b, NULL);
  want w = {.peak = {[SHP] = 15136,
                     [SHG] = 15136,
                     [PAR] = 26112,
                     [GRD] = 26112,
                     [RED] = 12544,
                     [BUF] = MLP_BUFFERS},
            .total = 89144,
            .reserved = 106488,
            .allocs = 25};
  expect(&e, &w, "MLP HYBRID_SHARD W=4 g=2");
  unbuild(&b);
}

static void test_mlp_bf16_params(void **state) {
  (void)state;
  built b = build(MLP, "world-size", "4", "wrap-type", "Linear", "param-dtype",
                  "bfloat16", NULL);
  /* master and gradient shards stay float32 (15136); the slots are
   * bfloat16: P = 512, 4224, 8320, 2080; reduce_dtype defaults to
   * param_dtype (FSDP1), so no red_in and R = c * 2 = 128, 1056, 2080,
   * 520.
   *   pre_bw(2)/post_bw(2)  params P0 + P2 + P1 = 13056, grads G0 + G3 +
   *               G2 = 10912, reduce R3 + R2 = 2600: 15672 + 26568 =
   *               42240                                      total peak
   *   pre_bw(1)   grads G0 + G2 + G1 = 13056
   *   post_bw(1)  reduce R2 + R1 = 3136
   * Reserved: 2 * (512 + 4224 + 8320 + 2080) + 1056 + 520 + 128 = 31976
   * (2080 serves P3, G3 and R2), + 15672 = 47648. */
  sp_mem_estimate e = estimate(&b, NULL);
  want w = {.peak = {[SHP] = 7568,
                     [SHG] = 7568,
                     [PAR] = 13056,
                     [GRD] = 13056,
                     [RED] = 3136,
                     [BUF] = MLP_BUFFERS},
            .total = 42240,
            .reserved = 47648,
            .allocs = 24};
  expect(&e, &w, "MLP FULL_SHARD W=4 bfloat16");
  unbuild(&b);
}

/* ---- GPT-2 at W = 8 ----
 * Units: root N0 = 39385344 (wte, wpe, ln_f; lm_head is tied), 12 blocks
 * NB = 7087872; both divide by 8: c0 = 4923168, cB = 885984, no padding.
 * Buffers: per block a [1, 1, 1024, 1024] bool mask and a float32 scalar:
 * 12 * 1048580 = 12582960. */

#define N0 39385344ull
#define NB 7087872ull
#define C0 (N0 / 8)
#define CB (NB / 8)
#define GPT2_BUFFERS 12582960ull
#define NALL (N0 + 12 * NB) /* 124439808 */

static const char *const k_dtypes[] = {"float32", "bfloat16"};

static void test_gpt2_full_shard(void **state) {
  (void)state;
  for (int i = 0; i < 2; i++) {
    built b = build(GPT2, "world-size", "8", "wrap-type", "GPT2Block",
                    "param-dtype", k_dtypes[i], NULL);
    uint64_t p = i == 0 ? 4 : 2;         /* param and reduce dtype */
    uint64_t shard = 4 * (C0 + 12 * CB); /* master and grads: float32 */
    uint64_t P0 = p * N0, PB = p * NB, RB = p * CB, R0 = p * C0;
    /* In steady backward, at post_bw(u): params root + u + the prefetched
     * u-1; grads root + u+1 (in flight) + u; reduce outputs of u+1 and u.
     * That is the peak of every category but the reduce buffers, whose
     * peak is R1 + R0 at post_bw(0); and of the total:
     *   2 shards + buffers + 2 (P0 + 2 PB) + 2 RB.
     * Reserved: two root-sized blocks, four block-sized, two RB, one R0. */
    want w = {
        .peak = {[SHP] = shard,
                 [SHG] = shard,
                 [PAR] = P0 + 2 * PB,
                 [GRD] = P0 + 2 * PB,
                 [RED] = R0 + RB,
                 [BUF] = GPT2_BUFFERS},
        .total = 2 * shard + GPT2_BUFFERS + 2 * (P0 + 2 * PB) + 2 * RB,
        .reserved = 2 * shard + GPT2_BUFFERS + 2 * P0 + 4 * PB + 2 * RB + R0,
        /* 2 per unit, 24 buffers, 9 pool blocks */
        .allocs = 26 + 24 + 9};
    sp_mem_estimate e = estimate(&b, NULL);
    expect(&e, &w, k_dtypes[i]);
    if (i == 0) {
      /* the figures `shardplane plan --memory` prints for float32 */
      assert_int_equal(e.acct.total.peak, 572599344);
      assert_int_equal(e.sharded_state, 124439808);
      /* floor: buffers + 2 P0 + 2 (2 PB + RB) */
      assert_int_equal(e.in_flight_floor,
                       GPT2_BUFFERS + 2 * P0 + 2 * (2 * PB + RB));
    }
    /* AdamW: two float32 moments per shard, 2 * 4 * 15554976 bytes, on top
     * of everything else */
    sp_mem_opts o;
    sp_mem_opts_default(&o);
    o.optimizer = SP_MEM_OPT_ADAMW;
    sp_mem_estimate a = estimate(&b, &o);
    assert_int_equal(a.acct.cat[OPT].peak, 8 * (C0 + 12 * CB));
    assert_int_equal(a.acct.total.peak, w.total + 8 * (C0 + 12 * CB));
    o.optimizer = SP_MEM_OPT_SGD_MOMENTUM;
    a = estimate(&b, &o);
    assert_int_equal(a.acct.cat[OPT].peak, 4 * (C0 + 12 * CB));
    unbuild(&b);
  }
}

static void test_gpt2_shard_grad_op(void **state) {
  (void)state;
  for (int i = 0; i < 2; i++) {
    built b =
        build(GPT2, "world-size", "8", "wrap-type", "GPT2Block", "strategy",
              "SHARD_GRAD_OP", "param-dtype", k_dtypes[i], NULL);
    uint64_t p = i == 0 ? 4 : 2;
    uint64_t shard = 4 * (C0 + 12 * CB);
    uint64_t P0 = p * N0, PB = p * NB, RB = p * CB, R0 = p * C0;
    uint64_t Pall = p * NALL;
    /* every unit unsharded from forward until its post_backward: params
     * peak at the end of forward (the whole model in param_dtype). The
     * total peaks at post_bw(11): params all but block 12, grads root +
     * blocks 12 and 11, reduce 12 and 11:
     *   Pall - PB + P0 + 2 PB + 2 RB = Pall + P0 + PB + 2 RB. */
    want w = {.peak = {[SHP] = shard,
                       [SHG] = shard,
                       [PAR] = Pall,
                       [GRD] = P0 + 2 * PB,
                       [RED] = R0 + RB,
                       [BUF] = GPT2_BUFFERS},
              .total = 2 * shard + GPT2_BUFFERS + Pall + P0 + PB + 2 * RB};
    sp_mem_estimate e = estimate(&b, NULL);
    expect(&e, &w, k_dtypes[i]);
    if (i == 0) assert_int_equal(e.acct.total.peak, 827762736);
    unbuild(&b);
  }
}

static void test_gpt2_no_shard(void **state) {
  (void)state;
  /* float32: the master and gradient shards of N elements are the
   * unsharded parameters and gradients, all from sp_fsdp_new; the
   * all-reduce in place needs nothing more. 0.94 GiB: at W = 1 (any
   * strategy) it was 1.87 GiB with the unsharded copies. */
  uint64_t all = 8 * NALL + GPT2_BUFFERS;
  want w32 = {
      .peak = {[SHP] = 4 * NALL, [SHG] = 4 * NALL, [BUF] = GPT2_BUFFERS},
      .total = all,
      .reserved = all,
      .allocs = 2 * 13 + 24};
  const char *worlds[] = {"8", "1"};
  for (int i = 0; i < 2; i++) {
    built b = build(GPT2, "world-size", worlds[i], "wrap-type", "GPT2Block",
                    "strategy", "NO_SHARD", NULL);
    sp_mem_estimate e = estimate(&b, NULL);
    expect(&e, &w32, worlds[i]);
    assert_int_equal(e.acct.total.current, all);
    assert_int_equal(e.acct.total.peak, 1008101424);
    unbuild(&b);
  }
  /* bfloat16 parameters: the unsharded parameters are a bfloat16 copy,
   * kept from sp_fsdp_new (2 NALL); the gradients are written in
   * bfloat16 into slots taken at pre_backward and given back when their
   * reduction, cast into the float32 gradient shard, is retired, as
   * FULL_SHARD's: at post_bw(u) the root's, u's and the last one in
   * flight, P0 + 2 PB (P = 2 N). Reserved: one root-sized slot and two
   * block-sized. 3 blocks per unit, 24 buffers, 3 pool blocks. */
  built b = build(GPT2, "world-size", "8", "wrap-type", "GPT2Block", "strategy",
                  "NO_SHARD", "param-dtype", "bfloat16", NULL);
  uint64_t kept = 8 * NALL + 2 * NALL + GPT2_BUFFERS;
  uint64_t slots = 2 * N0 + 2 * (2 * NB);
  want w16 = {.peak = {[SHP] = 4 * NALL,
                       [SHG] = 4 * NALL,
                       [PAR] = 2 * NALL,
                       [GRD] = slots,
                       [BUF] = GPT2_BUFFERS},
              .total = kept + slots,
              .reserved = kept + slots,
              .allocs = 3 * 13 + 24 + 3};
  sp_mem_estimate e = estimate(&b, NULL);
  expect(&e, &w16, "bfloat16");
  assert_int_equal(e.acct.total.current, kept);
  unbuild(&b);
  /* keep_low_precision_grads: the bfloat16 gradient shard is the
   * unsharded gradient; only the parameters have a low-precision copy */
  b = build(GPT2, "world-size", "8", "wrap-type", "GPT2Block", "strategy",
            "NO_SHARD", "param-dtype", "bfloat16", "keep-low-precision-grads",
            "1", NULL);
  uint64_t low = 4 * NALL + 2 * NALL + 2 * NALL + GPT2_BUFFERS;
  want wlow = {.peak = {[SHP] = 4 * NALL,
                        [SHG] = 2 * NALL,
                        [PAR] = 2 * NALL,
                        [BUF] = GPT2_BUFFERS},
               .total = low,
               .reserved = low,
               .allocs = 3 * 13 + 24};
  e = estimate(&b, NULL);
  expect(&e, &wlow, "bfloat16, keep_low_precision_grads");
  unbuild(&b);
}

static void test_gpt2_hybrid(void **state) {
  (void)state;
  for (int i = 0; i < 2; i++) {
    built b = build(GPT2, "world-size", "8", "wrap-type", "GPT2Block",
                    "strategy", "HYBRID_SHARD", "shard-group-size", "2",
                    "param-dtype", k_dtypes[i], NULL);
    uint64_t p = i == 0 ? 4 : 2;
    /* split over 2: c = N / 2; slots as ever (c * 2 = N); the schedule
     * and its peak points are FULL_SHARD's; the replica all-reduce runs
     * in the reduce output itself */
    uint64_t shard = 4 * (N0 / 2 + 12 * (NB / 2));
    uint64_t P0 = p * N0, PB = p * NB, RB = p * (NB / 2), R0 = p * (N0 / 2);
    want w = {.peak = {[SHP] = shard,
                       [SHG] = shard,
                       [PAR] = P0 + 2 * PB,
                       [GRD] = P0 + 2 * PB,
                       [RED] = R0 + RB,
                       [BUF] = GPT2_BUFFERS},
              .total = 2 * shard + GPT2_BUFFERS + 2 * (P0 + 2 * PB) + 2 * RB};
    sp_mem_estimate e = estimate(&b, NULL);
    expect(&e, &w, k_dtypes[i]);
    unbuild(&b);
  }
}

static void test_gpt2_no_sync(void **state) {
  (void)state;
  built b = build(GPT2, "world-size", "8", "wrap-type", "GPT2Block", NULL);
  uint64_t shard = 4 * (C0 + 12 * CB);
  uint64_t P0 = 4 * N0, PB = 4 * NB, RB = 4 * CB, R0 = 4 * C0;
  /* The first micro-batch keeps every gradient (Gall = 4 * NALL); in the
   * last one's backward they are all still there when block 12 and the
   * prefetched 11 are unsharded, and 12's and 11's reductions are queued:
   *   Gall + P0 + 2 PB + 2 RB on top of the persistent state. */
  sp_mem_opts o;
  sp_mem_opts_default(&o);
  o.no_sync = true;
  sp_mem_estimate e = estimate(&b, &o);
  want w = {
      .peak = {[SHP] = shard,
               [SHG] = shard,
               [PAR] = P0 + 2 * PB,
               [GRD] = 4 * NALL,
               [RED] = R0 + RB,
               [BUF] = GPT2_BUFFERS},
      .total = 2 * shard + GPT2_BUFFERS + 4 * NALL + P0 + 2 * PB + 2 * RB};
  expect(&e, &w, "no_sync");
  unbuild(&b);
}

/* Limiter 1 and no prefetch: the in-flight allowance shrinks. */
static void test_gpt2_limiter_and_prefetch(void **state) {
  (void)state;
  built b = build(GPT2, "world-size", "8", "wrap-type", "GPT2Block", NULL);
  uint64_t P0 = 4 * N0, PB = 4 * NB;
  sp_mem_opts o;
  sp_mem_opts_default(&o);
  o.backward_prefetch = false;
  sp_mem_estimate e = estimate(&b, &o);
  /* one block's parameters at a time */
  assert_int_equal(e.acct.cat[PAR].peak, P0 + PB);
  o.backward_prefetch = true;
  o.max_inflight = 1;
  e = estimate(&b, &o);
  /* one gradient slot of a block: each pre_backward retires the last
   * reduction first */
  assert_int_equal(e.acct.cat[GRD].peak, P0 + PB);
  assert_int_equal(e.acct.cat[PAR].peak, P0 + 2 * PB);
  unbuild(&b);
}

/* ---- the pool ---- */

static int g_live;

static int count_alloc(void *user, size_t n, size_t esize, void **out,
                       sp_diag *d) {
  (void)user, (void)d;
  *out = calloc(n ? n : 1, esize ? esize : 1);
  if (*out) g_live++;
  return *out ? 0 : SP_ENOMEM;
}

static void count_release(void *user, void *p) {
  (void)user;
  if (p) g_live--;
  free(p);
}

static void test_pool(void **state) {
  (void)state;
  sp_mem_pool p;
  sp_mem_pool_init(&p, count_alloc, count_release, NULL);
  void *a, *b, *c, *s;
  sp_diag d = {""};
  assert_int_equal(sp_mem_pool_alloc(&p, SHP, 10, 4, &s, &d), 0);
  assert_int_equal(sp_mem_pool_take(&p, PAR, 100, 4, &a, &d), 0);
  assert_int_equal(sp_mem_pool_take(&p, PAR, 100, 4, &b, &d), 0);
  assert_ptr_not_equal(a, b);
  assert_int_equal(p.acct.cat[PAR].current, 800);
  assert_int_equal(sp_mem_pool_release(&p, PAR, a, &d), 0);
  /* the same 400 bytes asked for as another category: the cached block */
  assert_int_equal(sp_mem_pool_take(&p, GRD, 200, 2, &c, &d), 0);
  assert_ptr_equal(c, a);
  assert_int_equal(p.acct.reuses, 1);
  /* another size: a new block */
  void *e;
  assert_int_equal(sp_mem_pool_take(&p, GRD, 101, 4, &e, &d), 0);
  assert_int_equal(p.acct.allocs, 4);
  assert_int_equal(p.acct.cat[PAR].peak, 800);
  assert_int_equal(p.acct.cat[PAR].current, 400);
  assert_int_equal(p.acct.cat[GRD].current, 804);
  assert_int_equal(p.acct.total.peak, 40 + 1204);
  assert_int_equal(p.acct.reserved.current, 40 + 1204);
  /* a released own block goes back to the allocator, a taken one stays */
  assert_int_equal(sp_mem_pool_release(&p, SHP, s, &d), 0);
  assert_int_equal(sp_mem_pool_release(&p, GRD, e, &d), 0);
  assert_int_equal(p.acct.reserved.current, 1204);
  assert_int_equal(g_live, 3);
  sp_mem_pool_reset_peaks(&p);
  assert_int_equal(p.acct.total.peak, 800);
  /* errors name what is wrong; the block is released all the same */
  assert_int_equal(sp_mem_pool_release(&p, PAR, c, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "unsharded grads"));
  assert_int_equal(sp_mem_pool_release(&p, GRD, c, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "twice"));
  int x;
  assert_int_equal(sp_mem_pool_release(&p, PAR, &x, &d), SP_EINVAL);
  assert_int_equal(sp_mem_pool_release(&p, PAR, NULL, &d), 0);
  assert_int_equal(sp_mem_pool_take(&p, PAR, SIZE_MAX / 2, 4, &a, &d),
                   SP_ETOOBIG);
  assert_non_null(strstr(d.msg, "unsharded params"));
  assert_int_equal(
      sp_mem_pool_alloc(&p, (sp_mem_cat)SP_MEM_N_CATS, 1, 1, &a, &d),
      SP_EINVAL);
  sp_mem_pool_destroy(&p);
  assert_int_equal(g_live, 0);
}

static void test_options(void **state) {
  (void)state;
  sp_mem_optimizer o;
  assert_int_equal(sp_mem_optimizer_parse("AdamW", &o), 0);
  assert_int_equal(o, SP_MEM_OPT_ADAMW);
  assert_int_equal(sp_mem_optimizer_parse("sgd-momentum", &o), 0);
  assert_int_equal(sp_mem_optimizer_states(o), 1);
  assert_int_equal(sp_mem_optimizer_parse("adam", &o), SP_EINVAL);
  assert_string_equal(sp_mem_optimizer_name(SP_MEM_OPT_NONE), "none");
  assert_string_equal(sp_mem_cat_name(SP_MEM_REDUCE), "reduce");
  built b = build(MLP, "world-size", "2", NULL);
  sp_mem_opts opts;
  sp_mem_opts_default(&opts);
  opts.max_inflight = SP_MEM_MAX_INFLIGHT + 1;
  sp_mem_estimate e;
  sp_diag d = {""};
  assert_int_equal(sp_mem_estimate_plan(b.pl, &opts, &e, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "max_inflight 65537"));
  sp_mem_opts_default(&opts);
  opts.optimizer = (sp_mem_optimizer)9;
  assert_int_equal(sp_mem_estimate_plan(b.pl, &opts, &e, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "optimizer 9"));
  assert_non_null(strstr(d.msg, "adamw"));
  unbuild(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mlp_full_shard),
      cmocka_unit_test(test_mlp_shard_grad_op),
      cmocka_unit_test(test_mlp_no_shard),
      cmocka_unit_test(test_mlp_flat),
      cmocka_unit_test(test_mlp_hybrid),
      cmocka_unit_test(test_mlp_bf16_params),
      cmocka_unit_test(test_gpt2_full_shard),
      cmocka_unit_test(test_gpt2_shard_grad_op),
      cmocka_unit_test(test_gpt2_no_shard),
      cmocka_unit_test(test_gpt2_hybrid),
      cmocka_unit_test(test_gpt2_no_sync),
      cmocka_unit_test(test_gpt2_limiter_and_prefetch),
      cmocka_unit_test(test_pool),
      cmocka_unit_test(test_options),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
