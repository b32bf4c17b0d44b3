/* Sharding plan: hand-computed FSDP cases, buffer dtypes keyed by FQN, tied
 * parameters, job validation, and property tests over random specs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <jansson.h>

#include "base/clock.h"
#include "plan/job.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "support/testutil.h"

/* ---- building specs ---- */

static sp_model *model_from(const char *json) {
  sp_model *m = NULL;
  sp_diag d = {""};
  if (sp_model_load_string(json, strlen(json), "test.json", &m, &d) != 0)
    fail_msg("spec rejected: %s", d.msg);
  return m;
}

static sp_model *model_from_json(json_t *spec) {
  char *s = json_dumps(spec, JSON_COMPACT);
  assert_non_null(s);
  sp_model *m = model_from(s);
  free(s);
  json_decref(spec);
  return m;
}

static json_t *new_spec(void) {
  return json_pack("{s:s,s:s,s:[{s:s,s:s}],s:[],s:[]}", "format",
                   "shardplane.model/v1", "name", "t", "modules", "fqn", "",
                   "type", "Net", "params", "buffers");
}

static void add_module(json_t *spec, const char *fqn, const char *type) {
  json_array_append_new(json_object_get(spec, "modules"),
                        json_pack("{s:s,s:s}", "fqn", fqn, "type", type));
}

static void add_tensor(json_t *spec, const char *key, const char *fqn,
                       const char *dtype, int nd, const int64_t *shape) {
  json_t *sh = json_array();
  for (int i = 0; i < nd; i++)
    json_array_append_new(sh, json_integer(shape[i]));
  json_array_append_new(
      json_object_get(spec, key),
      json_pack("{s:s,s:o,s:s}", "fqn", fqn, "shape", sh, "dtype", dtype));
}

static void add_param(json_t *spec, const char *fqn, int64_t numel) {
  add_tensor(spec, "params", fqn, "float32", 1, &numel);
}

static void add_buffer(json_t *spec, const char *fqn, const char *dtype) {
  int64_t n = 4;
  add_tensor(spec, "buffers", fqn, dtype, 1, &n);
}

static void add_tied(json_t *spec, const char *fqn, const char *to) {
  if (json_object_get(spec, "tied") == NULL)
    json_object_set_new(spec, "tied", json_array());
  json_array_append_new(json_object_get(spec, "tied"),
                        json_pack("{s:s,s:s}", "fqn", fqn, "to", to));
}

static sp_plan *plan_of(const sp_model *m, const sp_job *job) {
  sp_plan *p = NULL;
  sp_diag d = {""};
  if (sp_plan_build(m, job, &p, &d) != 0) fail_msg("plan failed: %s", d.msg);
  return p;
}

static sp_job job_w(uint32_t w) {
  sp_job j;
  sp_job_init(&j);
  j.world_size = w;
  return j;
}

/* ---- invariants every plan must satisfy ---- */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static void check_invariants(const sp_plan *pl) {
  const sp_model *m = pl->model;
  int64_t model_total = 0, flat_total = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    model_total += m->params[p].numel;
    int32_t u = pl->param_unit[p];
    assert_true(u >= 0 && (size_t)u < pl->n_units);
    const sp_flat_entry *fe = &pl->entries[pl->param_entry[p]];
    assert_int_equal(fe->param, p);
    assert_int_equal(fe->numel, m->params[p].numel);
  }
  for (uint32_t u = 0; u < pl->n_units; u++) {
    const sp_unit *x = &pl->units[u];
    int64_t off = 0;
    size_t real = 0;
    for (size_t e = x->first_entry; e < x->first_entry + x->n_entries; e++) {
      const sp_flat_entry *fe = &pl->entries[e];
      assert_int_equal(fe->offset, off); /* contiguous from 0 */
      off += fe->numel;
      if (fe->param >= 0) {
        real++;
        flat_total += fe->numel;
        assert_int_equal(pl->param_unit[fe->param], u);
      } else {
        assert_true(pl->use_orig_params);
      }
    }
    assert_int_equal(off, x->numel);
    assert_int_equal(real, x->n_params);
    int64_t c = pl->strategy == SP_NO_SHARD
                    ? x->numel
                    : ceil_div(x->numel, pl->shard_world);
    assert_int_equal(x->shard_numel, c);

    /* shards of one group cover [0, N) in order; padding only at the end */
    int64_t prev_end = 0;
    bool padded = false;
    int64_t *covered = calloc(x->n_entries + 1, sizeof *covered);
    assert_non_null(covered);
    uint32_t groups = pl->strategy == SP_NO_SHARD ? 1 : pl->shard_world;
    for (uint32_t r = 0; r < groups; r++) {
      int64_t s, e, pad;
      assert_int_equal(sp_plan_rank_range(pl, u, r, &s, &e, &pad), 0);
      assert_int_equal(s, prev_end);
      assert_true(e >= s && e - s <= c);
      assert_int_equal(pad, c - (e - s));
      if (padded) assert_int_equal(e - s, 0);
      if (pad > 0) padded = true;
      prev_end = e;

      size_t n;
      assert_int_equal(sp_plan_shard_params(pl, u, r, NULL, 0, &n), 0);
      sp_shard_param *sp = calloc(n + 1, sizeof *sp);
      assert_non_null(sp);
      size_t n2;
      assert_int_equal(sp_plan_shard_params(pl, u, r, sp, n, &n2), 0);
      assert_int_equal(n, n2);
      for (size_t i = 0; i < n; i++) {
        const sp_flat_entry *fe = &pl->entries[sp[i].entry];
        assert_true(fe->param >= 0);
        if (fe->numel == 0) continue;
        size_t k = sp[i].entry - x->first_entry;
        /* each param's slices follow each other with no gap or overlap */
        assert_int_equal(sp[i].intra_start, covered[k]);
        covered[k] += sp[i].numel_in_shard;
        assert_int_equal(sp[i].intra_end - sp[i].intra_start + 1,
                         sp[i].numel_in_shard);
        assert_int_equal(s + sp[i].offset_in_shard,
                         fe->offset + sp[i].intra_start);
        assert_true(sp[i].offset_in_shard + sp[i].numel_in_shard <= c);
      }
      free(sp);
    }
    assert_int_equal(prev_end, x->numel);
    for (size_t e = x->first_entry; e < x->first_entry + x->n_entries; e++)
      if (pl->entries[e].param >= 0)
        assert_int_equal(covered[e - x->first_entry], pl->entries[e].numel);
    free(covered);
    /* every rank holds the same slice as its shard index */
    for (uint32_t r = 0; r < pl->world_size; r++) {
      int64_t s1, e1, s2, e2;
      sp_plan_rank_range(pl, u, r, &s1, &e1, NULL);
      sp_plan_rank_range(pl, u, sp_plan_shard_index(pl, r), &s2, &e2, NULL);
      assert_int_equal(s1, s2);
      assert_int_equal(e1, e2);
    }
  }
  assert_int_equal(flat_total, model_total); /* each element owned once */
  assert_int_equal(strlen(pl->version_hex), 16);
}

/* ---- hand-computed FSDP cases (docs/fsdp.md, "Shard math") ---- */

typedef struct expect_sp {
  const char *fqn;
  int64_t off, numel, lo, hi;
} expect_sp;

static void check_rank(const sp_plan *pl, uint32_t u, uint32_t r, int64_t start,
                       int64_t end, int64_t pad, const expect_sp *want,
                       size_t n_want) {
  int64_t s, e, p;
  assert_int_equal(sp_plan_rank_range(pl, u, r, &s, &e, &p), 0);
  assert_int_equal(s, start);
  assert_int_equal(e, end);
  assert_int_equal(p, pad);
  sp_shard_param got[8];
  size_t n;
  assert_int_equal(sp_plan_shard_params(pl, u, r, got, 8, &n), 0);
  assert_int_equal(n, n_want);
  for (size_t i = 0; i < n; i++) {
    assert_string_equal(pl->entries[got[i].entry].fqn, want[i].fqn);
    assert_int_equal(got[i].offset_in_shard, want[i].off);
    assert_int_equal(got[i].numel_in_shard, want[i].numel);
    assert_int_equal(got[i].intra_start, want[i].lo);
    assert_int_equal(got[i].intra_end, want[i].hi);
  }
}

static void test_n10_w4(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_param(spec, "p0", 4);
  add_param(spec, "p1", 6);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(4);
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 1);
  assert_int_equal(pl->units[0].numel, 10);
  assert_int_equal(pl->units[0].shard_numel, 3);
  /* docs/fsdp.md, "Shard math": (offset_in_shard, numel, intra range) */
  const expect_sp r0[] = {{"p0", 0, 3, 0, 2}};
  const expect_sp r1[] = {{"p0", 0, 1, 3, 3}, {"p1", 1, 2, 0, 1}};
  const expect_sp r2[] = {{"p1", 0, 3, 2, 4}};
  const expect_sp r3[] = {{"p1", 0, 1, 5, 5}};
  check_rank(pl, 0, 0, 0, 3, 0, r0, 1);
  check_rank(pl, 0, 1, 3, 6, 0, r1, 2);
  check_rank(pl, 0, 2, 6, 9, 0, r2, 1);
  check_rank(pl, 0, 3, 9, 10, 2, r3, 1);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

static void test_n9_w4_empty_rank(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_param(spec, "w", 9);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(4);
  sp_plan *pl = plan_of(m, &j);
  const expect_sp r0[] = {{"w", 0, 3, 0, 2}};
  const expect_sp r2[] = {{"w", 0, 3, 6, 8}};
  check_rank(pl, 0, 0, 0, 3, 0, r0, 1);
  check_rank(pl, 0, 2, 6, 9, 0, r2, 1);
  check_rank(pl, 0, 3, 9, 9, 3, NULL, 0); /* empty, all padding */
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

static void test_param_spanning_ranks(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_param(spec, "a", 2);
  int64_t shape[2] = {3, 10};
  add_tensor(spec, "params", "big", "float32", 2, shape);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(4);
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->units[0].shard_numel, 8); /* ceil(32/4) */
  const expect_sp r0[] = {{"a", 0, 2, 0, 1}, {"big", 2, 6, 0, 5}};
  const expect_sp r1[] = {{"big", 0, 8, 6, 13}};
  const expect_sp r2[] = {{"big", 0, 8, 14, 21}};
  const expect_sp r3[] = {{"big", 0, 8, 22, 29}};
  check_rank(pl, 0, 0, 0, 8, 0, r0, 2);
  check_rank(pl, 0, 1, 8, 16, 0, r1, 1);
  check_rank(pl, 0, 2, 16, 24, 0, r2, 1);
  check_rank(pl, 0, 3, 24, 32, 0, r3, 1);
  sp_param_location loc;
  assert_int_equal(sp_plan_locate(pl, "big", &loc), 0);
  assert_int_equal(loc.offset, 2);
  assert_int_equal(loc.numel, 30);
  assert_int_equal(loc.first_shard, 0);
  assert_int_equal(loc.last_shard, 3);
  assert_int_equal(sp_plan_locate(pl, "nope", &loc), SP_ENOENT);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

static void test_n_less_than_w(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_param(spec, "w", 3);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(8);
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->units[0].shard_numel, 1);
  const expect_sp r2[] = {{"w", 0, 1, 2, 2}};
  check_rank(pl, 0, 2, 2, 3, 0, r2, 1);
  for (uint32_t r = 3; r < 8; r++) check_rank(pl, 0, r, 3, 3, 1, NULL, 0);
  assert_int_equal(sp_plan_rank_range(pl, 0, 8, NULL, NULL, NULL), SP_ERANGE);
  assert_int_equal(sp_plan_rank_range(pl, 1, 0, NULL, NULL, NULL), SP_ERANGE);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

static void test_alignment_padding(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_param(spec, "p0", 3);
  add_param(spec, "p1", 5);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(4);
  j.use_orig_params = true;
  sp_plan *pl = plan_of(m, &j);
  /* docs/fsdp.md, "Flatten order": [p0 3, pad 1, p1 5, pad 3], N = 12 */
  const sp_unit *u = &pl->units[0];
  assert_int_equal(u->n_entries, 4);
  const int64_t want[4][3] = {{0, 0, 3}, {-1, 3, 1}, {1, 4, 5}, {-1, 9, 3}};
  for (int i = 0; i < 4; i++) {
    assert_int_equal(pl->entries[u->first_entry + i].param, want[i][0]);
    assert_int_equal(pl->entries[u->first_entry + i].offset, want[i][1]);
    assert_int_equal(pl->entries[u->first_entry + i].numel, want[i][2]);
  }
  assert_int_equal(u->numel, 12);
  assert_int_equal(u->shard_numel, 3);
  const expect_sp r1[] = {{"p1", 1, 2, 0, 1}};
  check_rank(pl, 0, 1, 3, 6, 0, r1, 1);
  check_invariants(pl);
  sp_plan_free(pl);

  /* bfloat16 all-gathers align to 8 elements: [p0 3, pad 5, p1 5, pad 3] */
  j.mp.enabled = true;
  j.mp.param_dtype = SP_BFLOAT16;
  pl = plan_of(m, &j);
  u = &pl->units[0];
  assert_int_equal(pl->entries[u->first_entry + 1].numel, 5);
  assert_int_equal(pl->entries[u->first_entry + 2].offset, 8);
  assert_int_equal(u->numel, 16);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

static void test_strategies(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_param(spec, "w", 10);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(4);
  j.strategy = SP_NO_SHARD;
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->units[0].shard_numel, 10);
  for (uint32_t r = 0; r < 4; r++) {
    const expect_sp all[] = {{"w", 0, 10, 0, 9}};
    check_rank(pl, 0, r, 0, 10, 0, all, 1);
  }
  check_invariants(pl);
  sp_plan_free(pl);

  /* FSDP switches to NO_SHARD on a single rank */
  j = job_w(1);
  pl = plan_of(m, &j);
  assert_int_equal(pl->strategy, SP_NO_SHARD);
  check_invariants(pl);
  sp_plan_free(pl);

  /* HYBRID_SHARD: 8 ranks, shard groups of 4; rank r holds shard r % 4 */
  j = job_w(8);
  j.strategy = SP_HYBRID_SHARD;
  j.shard_group_size = 4;
  pl = plan_of(m, &j);
  assert_int_equal(pl->shard_world, 4);
  assert_int_equal(pl->units[0].shard_numel, 3);
  assert_int_equal(sp_plan_shard_index(pl, 6), 2);
  const expect_sp r6[] = {{"w", 0, 3, 6, 8}};
  check_rank(pl, 0, 6, 6, 9, 0, r6, 1);
  check_invariants(pl);
  sp_plan_free(pl);

  j.strategy = SP_SHARD_GRAD_OP;
  pl = plan_of(m, &j);
  assert_int_equal(pl->units[0].shard_numel, 2);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

/* ---- units, mixed precision and buffers ---- */

/* root
 *   enc (Block)
 *     lin (Linear)      weight, bias
 *     bn (BatchNorm2d)  weight, bias; running_mean f32, num_batches_tracked
 *   head (Linear)       weight
 */
static sp_model *block_model(void) {
  json_t *spec = new_spec();
  add_module(spec, "enc", "Block");
  add_module(spec, "enc.lin", "Linear");
  add_module(spec, "enc.bn", "BatchNorm2d");
  add_module(spec, "head", "Linear");
  add_param(spec, "enc.lin.weight", 12);
  add_param(spec, "enc.lin.bias", 3);
  add_param(spec, "enc.bn.weight", 3);
  add_param(spec, "enc.bn.bias", 3);
  add_param(spec, "head.weight", 6);
  add_buffer(spec, "enc.bn.running_mean", "float32");
  add_buffer(spec, "enc.bn.num_batches_tracked", "int64");
  return model_from_json(spec);
}

static void test_units_and_full_precision(void **state) {
  (void)state;
  sp_model *m = block_model();
  sp_job j = job_w(2);
  sp_strlist_add(&j.wrap_types, "Block");
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 2);
  assert_string_equal(sp_plan_unit_fqn(pl, 1), "enc");
  assert_int_equal(pl->units[1].parent, 0);
  assert_int_equal(pl->units[1].numel, 12 + 3 + 3 + 3);
  assert_int_equal(pl->units[0].numel, 6); /* root keeps only head */
  assert_int_equal(pl->buffers[0].unit, 1);
  assert_int_equal(pl->buffers[0].compute_dtype, SP_FLOAT32);
  check_invariants(pl);
  sp_plan_free(pl);

  /* With mixed precision the BatchNorm becomes its own full-precision unit
   * (FSDP's _module_classes_to_ignore): its buffers keep float32. */
  j.mp.enabled = true;
  j.mp.param_dtype = SP_BFLOAT16;
  j.mp.buffer_dtype = SP_FLOAT16;
  pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 3);
  assert_string_equal(sp_plan_unit_fqn(pl, 2), "enc.bn");
  const sp_unit *bn = &pl->units[2];
  assert_true(bn->full_precision);
  assert_false(bn->mixed_precision);
  assert_int_equal(bn->param_dtype, SP_FLOAT32);
  assert_int_equal(bn->buffer_dtype, SP_DTYPE_INVALID);
  assert_int_equal(bn->parent, 1);
  assert_int_equal(pl->units[1].numel, 15);
  const sp_unit *enc = &pl->units[1];
  assert_int_equal(enc->param_dtype, SP_BFLOAT16);
  assert_int_equal(enc->reduce_dtype, SP_BFLOAT16); /* unset -> param_dtype */
  assert_int_equal(pl->buffers[0].unit, 2);
  assert_int_equal(pl->buffers[0].compute_dtype, SP_FLOAT32);
  assert_int_equal(pl->buffers[1].compute_dtype, SP_INT64);
  check_invariants(pl);
  sp_plan_free(pl);

  /* Explicit empty list: no full-precision units; reduce_dtype explicit */
  j.mp.full_precision_types_set = true;
  j.mp.reduce_dtype = SP_FLOAT32;
  pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 2);
  assert_int_equal(pl->units[1].reduce_dtype, SP_FLOAT32);
  assert_int_equal(pl->buffers[0].compute_dtype, SP_FLOAT16);
  assert_int_equal(pl->buffers[1].compute_dtype, SP_INT64);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_job_clear(&j);
  sp_model_free(m);
}

/* The bug class of pytorch PR #87935: same local buffer name, different
 * dtypes, in different submodules. Every FQN keeps its own original dtype. */
static void test_same_local_name_buffers(void **state) {
  (void)state;
  static const char *const dtypes[] = {"float64", "float16", "bfloat16",
                                       "int64", "bool"};
  json_t *spec = new_spec();
  for (int i = 0; i < 5; i++) {
    char fqn[32];
    snprintf(fqn, sizeof fqn, "m%d", i);
    add_module(spec, fqn, i < 2 ? "Wrapped" : "Plain");
    char p[48];
    snprintf(p, sizeof p, "m%d.weight", i);
    add_param(spec, p, 5);
    snprintf(p, sizeof p, "m%d.stat", i);
    add_buffer(spec, p, dtypes[i]);
  }
  sp_model *m = model_from_json(spec);
  for (int with = 0; with < 2; with++) {
    sp_job j = job_w(3);
    sp_strlist_add(&j.wrap_types, "Wrapped");
    if (with) {
      j.mp.enabled = true;
      j.mp.buffer_dtype = SP_BFLOAT16;
    }
    sp_plan *pl = plan_of(m, &j);
    assert_int_equal(pl->n_units, 3);
    for (int i = 0; i < 5; i++) {
      char fqn[32];
      snprintf(fqn, sizeof fqn, "m%d.stat", i);
      int32_t b = sp_plan_find_buffer(pl, fqn);
      assert_true(b >= 0);
      sp_dtype orig;
      assert_int_equal(sp_dtype_parse(dtypes[i], &orig), 0);
      assert_int_equal(pl->buffers[b].orig_dtype, orig);
      sp_dtype want = with && sp_dtype_is_floating(orig) ? SP_BFLOAT16 : orig;
      assert_int_equal(pl->buffers[b].compute_dtype, want);
      assert_int_equal(pl->buffers[b].unit, i < 2 ? i + 1 : 0);
    }
    check_invariants(pl);
    sp_plan_free(pl);
    sp_job_clear(&j);
  }
  sp_model_free(m);
}

/* Buffers take the buffer_dtype of the innermost owning unit, and a unit
 * without mixed precision keeps its buffers as they are. */
static void test_buffer_owner_innermost(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_module(spec, "outer", "Outer");
  add_module(spec, "outer.inner", "Norm");
  add_module(spec, "outer.inner.deep", "Leaf");
  add_param(spec, "outer.w", 4);
  add_buffer(spec, "outer.inner.deep.running_var", "float32");
  add_buffer(spec, "outer.running_var", "float64");
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(2);
  sp_strlist_add(&j.wrap_types, "Outer");
  sp_strlist_add(&j.mp.full_precision_types, "Norm");
  j.mp.full_precision_types_set = true;
  j.mp.enabled = true;
  j.mp.buffer_dtype = SP_FLOAT16;
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 3);
  int32_t deep = sp_plan_find_buffer(pl, "outer.inner.deep.running_var");
  int32_t out = sp_plan_find_buffer(pl, "outer.running_var");
  assert_string_equal(sp_plan_unit_fqn(pl, (uint32_t)pl->buffers[deep].unit),
                      "outer.inner");
  assert_int_equal(pl->buffers[deep].compute_dtype, SP_FLOAT32);
  assert_string_equal(sp_plan_unit_fqn(pl, (uint32_t)pl->buffers[out].unit),
                      "outer");
  assert_int_equal(pl->buffers[out].compute_dtype, SP_FLOAT16);
  assert_int_equal(pl->buffers[out].orig_dtype, SP_FLOAT64);
  assert_int_equal(pl->units[2].numel, 0); /* a unit with no params */
  check_invariants(pl);
  sp_plan_free(pl);
  sp_job_clear(&j);
  sp_model_free(m);
}

/* ---- tied parameters ---- */

static void test_tied_first_occurrence(void **state) {
  (void)state;
  /* head comes before emb in named_modules, so FSDP flattens the shared
   * tensor under "head.weight" and "emb.weight" becomes the alias */
  json_t *spec = new_spec();
  add_module(spec, "head", "Linear");
  add_module(spec, "emb", "Embedding");
  add_param(spec, "emb.weight", 8);
  add_param(spec, "head.bias", 2);
  add_tied(spec, "head.weight", "emb.weight");
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(2);
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->units[0].numel, 10);
  const sp_unit *u = &pl->units[0];
  assert_string_equal(pl->entries[u->first_entry].fqn, "head.bias");
  assert_string_equal(pl->entries[u->first_entry + 1].fqn, "head.weight");
  assert_int_equal(pl->n_aliases, 1);
  assert_string_equal(pl->aliases[0].fqn, "emb.weight");
  sp_param_location a, b;
  assert_int_equal(sp_plan_locate(pl, "emb.weight", &a), 0);
  assert_int_equal(sp_plan_locate(pl, "head.weight", &b), 0);
  assert_true(a.is_alias);
  assert_false(b.is_alias);
  assert_int_equal(a.offset, b.offset);
  assert_int_equal(a.offset, 2);
  check_invariants(pl);
  sp_plan_free(pl);

  /* emb wrapped as its own unit claims the tensor first (post-order), and
   * the root only refers to it */
  sp_strlist_add(&j.wrap_modules, "emb");
  pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 2);
  assert_int_equal(pl->units[0].numel, 2);
  assert_int_equal(pl->units[1].numel, 8);
  assert_int_equal(sp_plan_locate(pl, "head.weight", &b), 0);
  assert_true(b.is_alias);
  assert_int_equal(b.unit, 1);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_job_clear(&j);
  sp_model_free(m);
}

static sp_model *load_example(const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/models/%s.json", SP_EXAMPLES, name);
  sp_model *m = NULL;
  sp_diag d = {""};
  if (sp_model_load_file(path, &m, &d) != 0) fail_msg("%s", d.msg);
  return m;
}

static void test_gpt2_tied_plan(void **state) {
  (void)state;
  sp_model *m = load_example("gpt2");
  sp_job j = job_w(8);
  sp_strlist_add(&j.wrap_types, "GPT2Block");
  sp_plan *pl = plan_of(m, &j);
  assert_int_equal(pl->n_units, 13);
  sp_param_location wte, head;
  assert_int_equal(sp_plan_locate(pl, "transformer.wte.weight", &wte), 0);
  assert_int_equal(sp_plan_locate(pl, "lm_head.weight", &head), 0);
  assert_true(head.is_alias);
  assert_false(wte.is_alias);
  assert_int_equal(head.offset, wte.offset);
  assert_int_equal(head.unit, 0);
  /* 50257*768 + 1024*768 + ln_f (2*768): the tie is not flattened twice */
  assert_int_equal(pl->units[0].numel, 50257 * 768 + 1024 * 768 + 2 * 768);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_job_clear(&j);
  sp_model_free(m);
}

/* ---- errors ---- */

static void test_plan_errors(void **state) {
  (void)state;
  json_t *spec = new_spec();
  add_module(spec, "a", "Linear");
  add_param(spec, "a.w", 4);
  int64_t n = 4;
  add_tensor(spec, "params", "a.h", "float16", 1, &n);
  sp_model *m = model_from_json(spec);
  sp_job j = job_w(2);
  sp_plan *pl = NULL;
  sp_diag d = {""};
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EFORMAT);
  assert_null(pl);
  assert_non_null(strstr(d.msg, "a.h"));
  assert_non_null(strstr(d.msg, "a.w"));
  assert_non_null(strstr(d.msg, "one dtype"));

  sp_strlist_add(&j.wrap_types, "Missing");
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "wrap.types[0]"));
  assert_non_null(strstr(d.msg, "Missing"));
  sp_job_clear(&j);

  j = job_w(2);
  sp_strlist_add(&j.wrap_modules, "a.zz");
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "a.zz"));
  sp_job_clear(&j);

  j = job_w(0);
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "world_size"));

  j = job_w(6);
  j.strategy = SP_HYBRID_SHARD;
  j.shard_group_size = 4;
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "shard_group_size"));
  j.shard_group_size = 0;
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EINVAL);
  sp_model_free(m);

  /* mixed requires_grad: an error unless use_orig_params */
  const char *json =
      "{\"format\":\"shardplane.model/v1\",\"modules\":[{\"fqn\":\"\","
      "\"type\":\"N\"}],\"params\":[{\"fqn\":\"w\",\"shape\":[2],\"dtype\":"
      "\"float32\"},{\"fqn\":\"f\",\"shape\":[2],\"dtype\":\"float32\","
      "\"requires_grad\":false}]}";
  m = model_from(json);
  j = job_w(2);
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), SP_EFORMAT);
  assert_non_null(strstr(d.msg, "requires_grad"));
  j.use_orig_params = true;
  pl = plan_of(m, &j);
  check_invariants(pl);
  sp_plan_free(pl);
  sp_model_free(m);
}

static void test_job_file(void **state) {
  (void)state;
  const char *good =
      "{\"format\":\"shardplane.job/v1\",\"world_size\":16,\"strategy\":"
      "\"hybrid_shard\",\"shard_group_size\":8,\"wrap\":{\"types\":["
      "\"Block\"],\"modules\":[\"head\"]},\"mixed_precision\":{"
      "\"param_dtype\":\"bfloat16\",\"reduce_dtype\":\"float32\","
      "\"buffer_dtype\":null,\"keep_low_precision_grads\":true,"
      "\"full_precision_types\":[]},\"backend\":\"nccl\","
      "\"use_orig_params\":true}";
  sp_job j;
  sp_job_init(&j);
  sp_diag d = {""};
  assert_int_equal(sp_job_load_string(good, strlen(good), "job.json", &j, &d),
                   0);
  assert_int_equal(j.world_size, 16);
  assert_int_equal(j.strategy, SP_HYBRID_SHARD);
  assert_int_equal(j.shard_group_size, 8);
  assert_true(sp_strlist_contains(&j.wrap_types, "Block"));
  assert_true(sp_strlist_contains(&j.wrap_modules, "head"));
  assert_true(j.mp.enabled);
  assert_int_equal(j.mp.param_dtype, SP_BFLOAT16);
  assert_int_equal(j.mp.reduce_dtype, SP_FLOAT32);
  assert_int_equal(j.mp.buffer_dtype, SP_DTYPE_INVALID);
  assert_true(j.mp.keep_low_precision_grads);
  assert_true(j.mp.full_precision_types_set);
  assert_false(sp_job_full_precision_type(&j, "BatchNorm2d"));
  assert_int_equal(j.backend, SP_BACKEND_NCCL);
  assert_true(j.use_orig_params);
  sp_job_clear(&j);

  const struct {
    const char *json, *expect;
  } bad[] = {
      {"{\"world_size\":0}", "world_size"},
      {"{\"world_size\":\"4\"}", "world_size: expected an integer"},
      {"{\"strategy\":\"ZERO3\"}", "strategy: unknown value \"ZERO3\""},
      {"{\"backend\":\"mpi\"}", "backend"},
      {"{\"mixed_precision\":{\"param_dtype\":\"int8\"}}",
       "mixed_precision.param_dtype"},
      {"{\"mixed_precision\":{\"reduce_dtype\":3}}",
       "mixed_precision.reduce_dtype"},
      {"{\"wrap\":{\"types\":[1]}}", "wrap.types[0]"},
      {"{\"wrap\":[]}", "wrap: expected an object"},
      {"{\"format\":\"shardplane.model/v1\"}", "format"},
      {"{\"world_size\":2,", "invalid JSON"},
      /* a misspelt key, at any level, is an error naming the nearest one */
      {"{\"stratgy\":\"NO_SHARD\"}",
       "job.json: unknown key \"stratgy\" (did you mean \"strategy\"?)"},
      {"{\"mixed_precison\":{\"param_dtype\":\"bfloat16\"}}",
       "unknown key \"mixed_precison\" (did you mean \"mixed_precision\"?)"},
      {"{\"wrap\":{\"type\":[\"Block\"]}}",
       "unknown key \"type\" in wrap (did you mean \"types\"?)"},
      {"{\"mixed_precision\":{\"param_dtype\":\"bfloat16\","
       "\"reduce_dtpye\":\"float32\"}}",
       "unknown key \"reduce_dtpye\" in mixed_precision (did you mean "
       "\"reduce_dtype\"?)"},
      {"{\"colour\":\"blue\"}",
       "unknown key \"colour\" (expected format, world_size, strategy,"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    sp_job_init(&j);
    int rc = sp_job_load_string(bad[i].json, strlen(bad[i].json), "job.json",
                                &j, &d);
    if (rc == 0 || strstr(d.msg, bad[i].expect) == NULL ||
        strncmp(d.msg, "job.json", 8) != 0)
      fail_msg("job case %zu: rc %d msg \"%s\" want \"%s\"", i, rc, d.msg,
               bad[i].expect);
    sp_job_clear(&j);
  }
  /* default full-precision types apply only with mixed precision */
  sp_job_init(&j);
  assert_false(sp_job_full_precision_type(&j, "BatchNorm2d"));
  j.mp.enabled = true;
  assert_true(sp_job_full_precision_type(&j, "BatchNorm2d"));
  assert_true(sp_job_full_precision_type(&j, "SyncBatchNorm"));
  assert_false(sp_job_full_precision_type(&j, "LayerNorm"));
}

/* ---- version ---- */

static void test_version(void **state) {
  (void)state;
  sp_model *m = block_model();
  sp_model *m2 = block_model();
  sp_job j = job_w(4);
  sp_plan *a = plan_of(m, &j), *b = plan_of(m2, &j);
  assert_string_equal(a->version_hex, b->version_hex);
  j.world_size = 5;
  sp_plan *c = plan_of(m, &j);
  assert_string_not_equal(a->version_hex, c->version_hex);
  j.world_size = 4;
  j.mp.enabled = true;
  j.mp.buffer_dtype = SP_FLOAT16;
  j.mp.full_precision_types_set = true;
  sp_plan *d = plan_of(m, &j);
  assert_string_not_equal(a->version_hex, d->version_hex);
  sp_plan_free(a);
  sp_plan_free(b);
  sp_plan_free(c);
  sp_plan_free(d);
  sp_model_free(m);
  sp_model_free(m2);
}

/* ---- property tests over random specs ---- */

static void random_subtree(json_t *spec, sp_test_rng *rng, const char *fqn,
                           int depth, int *budget, sp_strlist *wrap) {
  int kids = depth < 4 ? (int)sp_test_rng_below(rng, 4) : 0;
  int params = (int)sp_test_rng_below(rng, 4);
  for (int p = 0; p < params; p++) {
    char name[320]; /* fqn (under 300) plus a short local name */
    snprintf(name, sizeof name, "%s%sp%d", fqn, fqn[0] ? "." : "", p);
    int nd = (int)sp_test_rng_below(rng, 4);
    int64_t shape[3];
    for (int d = 0; d < nd; d++)
      shape[d] = (int64_t)sp_test_rng_below(rng, 9); /* 0: zero-size */
    add_tensor(spec, "params", name, "float32", nd, shape);
    if (sp_test_rng_below(rng, 4) == 0) {
      snprintf(name, sizeof name, "%s%sb%d", fqn, fqn[0] ? "." : "", p);
      add_buffer(spec, name, sp_test_rng_below(rng, 2) ? "float32" : "int64");
    }
  }
  for (int k = 0; k<kids && * budget> 0; k++) {
    (*budget)--;
    char child[300]; /* depth <= 4: far below this */
    if (snprintf(child, sizeof child, "%s%sm%d", fqn, fqn[0] ? "." : "", k) < 0)
      fail_msg("snprintf");
    add_module(spec, child, "Mod");
    if (sp_test_rng_below(rng, 3) == 0) sp_strlist_add(wrap, child);
    random_subtree(spec, rng, child, depth + 1, budget, wrap);
  }
}

static void test_random_specs(void **state) {
  (void)state;
  sp_test_rng rng = {2024};
  for (int iter = 0; iter < 300; iter++) {
    json_t *spec = new_spec();
    int budget = 30;
    sp_job j;
    sp_job_init(&j);
    random_subtree(spec, &rng, "", 0, &budget, &j.wrap_modules);
    sp_model *m = model_from_json(spec);
    j.world_size = 1 + (uint32_t)sp_test_rng_below(&rng, 17);
    j.strategy = (sp_strategy)(1 + sp_test_rng_below(&rng, 4));
    if (j.strategy == SP_HYBRID_SHARD) {
      uint32_t g;
      do {
        g = 1 + (uint32_t)sp_test_rng_below(&rng, j.world_size);
      } while (j.world_size % g != 0);
      j.shard_group_size = g;
    }
    j.use_orig_params = sp_test_rng_below(&rng, 2);
    if (sp_test_rng_below(&rng, 2)) {
      j.mp.enabled = true;
      j.mp.param_dtype = SP_BFLOAT16;
    }
    sp_plan *pl = plan_of(m, &j);
    check_invariants(pl);
    sp_plan_free(pl);
    sp_job_clear(&j);
    sp_model_free(m);
  }
}

/* ---- the real specs, and the size goal ---- */

static void test_real_specs_plan(void **state) {
  (void)state;
  const struct {
    const char *spec, *wrap;
    uint32_t world;
  } cases[] = {
      {"resnet50", "Bottleneck", 8},          {"mobilenet_v3_small", NULL, 3},
      {"vit_b_16", "EncoderBlock", 16},       {"gpt2", "GPT2Block", 7},
      {"llama2_7b", "LlamaDecoderLayer", 64},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sp_model *m = load_example(cases[i].spec);
    for (int mp = 0; mp < 2; mp++) {
      sp_job j = job_w(cases[i].world);
      if (cases[i].wrap) sp_strlist_add(&j.wrap_types, cases[i].wrap);
      if (mp) {
        j.mp.enabled = true;
        j.mp.param_dtype = SP_BFLOAT16;
        j.mp.buffer_dtype = SP_BFLOAT16;
      }
      sp_plan *pl = plan_of(m, &j);
      check_invariants(pl);
      /* every floating buffer under a mixed unit is computed in bf16; the
       * BatchNorm ones stay float32, num_batches_tracked stays int64 */
      for (size_t b = 0; b < pl->n_buffers; b++) {
        const sp_plan_buffer *pb = &pl->buffers[b];
        const sp_unit *u = &pl->units[pb->unit];
        if (!sp_dtype_is_floating(pb->orig_dtype) || !u->mixed_precision)
          assert_int_equal(pb->compute_dtype, pb->orig_dtype);
        else
          assert_int_equal(pb->compute_dtype, SP_BFLOAT16);
      }
      sp_plan_free(pl);
      sp_job_clear(&j);
    }
    sp_model_free(m);
  }
}

static void test_llama70b_w1024_fast(void **state) {
  (void)state;
  double t0 = (sp_clock_s() * 1e3);
  sp_model *m = load_example("llama2_70b");
  double t1 = (sp_clock_s() * 1e3);
  sp_job j = job_w(1024);
  sp_strlist_add(&j.wrap_types, "LlamaDecoderLayer");
  j.mp.enabled = true;
  j.mp.param_dtype = SP_BFLOAT16;
  sp_plan *pl = plan_of(m, &j);
  double t2 = (sp_clock_s() * 1e3);
  /* all per-rank shard lists, as a coordinator answering every rank would */
  size_t total = 0;
  for (uint32_t r = 0; r < 1024; r++)
    for (uint32_t u = 0; u < pl->n_units; u++) {
      size_t n;
      sp_plan_shard_params(pl, u, r, NULL, 0, &n);
      total += n;
    }
  double t3 = (sp_clock_s() * 1e3);
  printf(
      "llama2_70b W=1024: load %.2f ms, plan %.2f ms, all rank shard "
      "lists %.2f ms (%zu entries), %zu units\n",
      t1 - t0, t2 - t1, t3 - t2, total, pl->n_units);
  assert_int_equal(pl->n_units, 81);
  assert_true(t2 - t0 < 1000.0);
  assert_true(total >= 723);
  sp_plan_free(pl);
  sp_job_clear(&j);
  sp_model_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_n10_w4),
      cmocka_unit_test(test_n9_w4_empty_rank),
      cmocka_unit_test(test_param_spanning_ranks),
      cmocka_unit_test(test_n_less_than_w),
      cmocka_unit_test(test_alignment_padding),
      cmocka_unit_test(test_strategies),
      cmocka_unit_test(test_units_and_full_precision),
      cmocka_unit_test(test_same_local_name_buffers),
      cmocka_unit_test(test_buffer_owner_innermost),
      cmocka_unit_test(test_tied_first_occurrence),
      cmocka_unit_test(test_gpt2_tied_plan),
      cmocka_unit_test(test_plan_errors),
      cmocka_unit_test(test_job_file),
      cmocka_unit_test(test_version),
      cmocka_unit_test(test_random_specs),
      cmocka_unit_test(test_real_specs_plan),
      cmocka_unit_test(test_llama70b_w1024_fast),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
