/* Model spec loader: every real spec loads, and every kind of bad spec is
 * rejected with a message naming the file, the JSON path and the problem. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/model.h"
#include "plan/plan.h"
#include "support/testutil.h"

static const char *const k_specs[] = {
    "gpt2",      "gpt2-tiny",          "gpt2-mini", "llama2_70b",
    "llama2_7b", "mobilenet_v3_small", "resnet50",  "vit_b_16"};

static sp_model *load_example(const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/models/%s.json", SP_EXAMPLES, name);
  sp_model *m = NULL;
  sp_diag d = {""};
  int rc = sp_model_load_file(path, &m, &d);
  if (rc != 0) fail_msg("%s: %s", path, d.msg);
  return m;
}

static void test_real_specs_load(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof k_specs / sizeof k_specs[0]; i++) {
    sp_model *m = load_example(k_specs[i]);
    assert_string_equal(m->name, k_specs[i]);
    assert_true(m->n_modules > 0);
    assert_string_equal(m->modules[0].fqn, "");
    assert_int_equal(m->modules[0].parent, -1);
    assert_int_equal(m->modules[0].subtree_end, m->n_modules);
    /* every entry resolves back to itself through the FQN index */
    for (size_t k = 0; k < m->n_modules; k++)
      assert_int_equal(sp_model_find_module(m, m->modules[k].fqn), k);
    for (size_t k = 0; k < m->n_params; k++) {
      assert_int_equal(sp_model_find_param(m, m->params[k].fqn), k);
      assert_true(sp_dtype_is_floating(m->params[k].dtype));
    }
    for (size_t k = 0; k < m->n_buffers; k++)
      assert_int_equal(sp_model_find_buffer(m, m->buffers[k].fqn), k);
    sp_model_free(m);
  }
}

static void test_resnet_details(void **state) {
  (void)state;
  sp_model *m = load_example("resnet50");
  int32_t bn = sp_model_find_module(m, "layer1.0.bn1");
  assert_true(bn > 0);
  assert_string_equal(m->modules[bn].type, "BatchNorm2d");
  assert_string_equal(m->modules[m->modules[bn].parent].fqn, "layer1.0");
  int32_t p = sp_model_find_param(m, "conv1.weight");
  assert_true(p >= 0);
  assert_int_equal(m->params[p].ndim, 4);
  assert_int_equal(m->params[p].shape[0], 64);
  assert_int_equal(m->params[p].numel, 64 * 3 * 7 * 7);
  assert_string_equal(m->params[p].local_name, "weight");
  int32_t b = sp_model_find_buffer(m, "bn1.num_batches_tracked");
  assert_true(b >= 0);
  assert_int_equal(m->buffers[b].dtype, SP_INT64);
  assert_int_equal(m->buffers[b].ndim, 0);
  assert_int_equal(m->buffers[b].numel, 1);
  /* the subtree of layer1 is contiguous and ends where layer2 starts */
  int32_t l1 = sp_model_find_module(m, "layer1");
  int32_t l2 = sp_model_find_module(m, "layer2");
  assert_int_equal(m->modules[l1].subtree_end, (uint32_t)l2);
  assert_int_equal(sp_model_find_param(m, "nope.weight"), -1);
  assert_int_equal(sp_model_find_module(m, "conv1.weight"), -1);
  sp_model_free(m);
}

static void test_gpt2_tied(void **state) {
  (void)state;
  sp_model *m = load_example("gpt2");
  assert_int_equal(m->n_tied, 1);
  assert_string_equal(m->tied[0].fqn, "lm_head.weight");
  assert_string_equal(m->params[m->tied[0].target].fqn,
                      "transformer.wte.weight");
  assert_string_equal(m->modules[m->tied[0].module].fqn, "lm_head");
  /* the bool causal mask and the scalar float buffer */
  int32_t b = sp_model_find_buffer(m, "transformer.h.3.attn.bias");
  assert_int_equal(m->buffers[b].dtype, SP_BOOL);
  b = sp_model_find_buffer(m, "transformer.h.3.attn.masked_bias");
  assert_int_equal(m->buffers[b].dtype, SP_FLOAT32);
  assert_int_equal(m->buffers[b].ndim, 0);
  sp_model_free(m);
}

/* The byte-level GPT-2s the worker trains: HF names and Conv1D layouts
 * ([in, out]), the head count in "config", and a plan wrapping the blocks
 * (one unit per block plus the root, which owns the embeddings, ln_f and
 * the tied head). */
static void test_gpt2_family(void **state) {
  (void)state;
  static const struct {
    const char *name;
    int64_t layers, d, heads, ctx;
  } k[] = {{"gpt2-tiny", 2, 64, 4, 64}, {"gpt2-mini", 6, 384, 6, 256}};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    sp_model *m = load_example(k[i].name);
    int64_t v = 0;
    assert_int_equal(sp_model_config_int(m, "n_head", &v), 0);
    assert_int_equal(v, k[i].heads);
    assert_int_equal(sp_model_config_int(m, "n_layer", &v), 0);
    assert_int_equal(v, k[i].layers);
    assert_int_equal(sp_model_config_int(m, "nope", &v), SP_ENOENT);
    int32_t p = sp_model_find_param(m, "transformer.wte.weight");
    assert_int_equal(m->params[p].shape[0], 256);
    assert_int_equal(m->params[p].shape[1], k[i].d);
    p = sp_model_find_param(m, "transformer.wpe.weight");
    assert_int_equal(m->params[p].shape[0], k[i].ctx);
    char fqn[128];
    snprintf(fqn, sizeof fqn, "transformer.h.%lld.attn.c_attn.weight",
             (long long)(k[i].layers - 1));
    p = sp_model_find_param(m, fqn);
    assert_true(p >= 0);
    assert_int_equal(m->params[p].shape[0], k[i].d);
    assert_int_equal(m->params[p].shape[1], 3 * k[i].d);
    p = sp_model_find_param(m, "transformer.h.0.mlp.c_proj.weight");
    assert_int_equal(m->params[p].shape[0], 4 * k[i].d);
    assert_int_equal(m->params[p].shape[1], k[i].d);
    int32_t b = sp_model_find_buffer(m, "transformer.h.0.attn.bias");
    assert_int_equal(m->buffers[b].dtype, SP_BOOL);
    assert_int_equal(m->buffers[b].shape[3], k[i].ctx);
    assert_int_equal(m->n_tied, 1);
    assert_string_equal(m->params[m->tied[0].target].fqn,
                        "transformer.wte.weight");
    sp_job job;
    sp_job_init(&job);
    job.world_size = 4;
    assert_int_equal(sp_strlist_add(&job.wrap_types, "GPT2Block"), 0);
    sp_plan *pl = NULL;
    sp_diag d = {""};
    if (sp_plan_build(m, &job, &pl, &d) != 0) fail_msg("%s", d.msg);
    assert_int_equal(pl->n_units, (size_t)k[i].layers + 1);
    assert_int_equal(
        pl->param_unit[sp_model_find_param(m, "transformer.ln_f.bias")], 0);
    sp_plan_free(pl);
    sp_job_clear(&job);
    sp_model_free(m);
  }
  /* only integers are kept; anything else in an HF config is skipped */
  static const char js[] =
      "{\"format\":\"shardplane.model/v1\",\"name\":\"c\",\"modules\":"
      "[{\"fqn\":\"\",\"type\":\"Net\"}],\"params\":[],\"config\":"
      "{\"n_head\":3,\"layer_norm_epsilon\":1e-5,\"activation\":\"gelu\"}}";
  sp_model *m = NULL;
  sp_diag d = {""};
  if (sp_model_load_string(js, strlen(js), "c.json", &m, &d) != 0)
    fail_msg("%s", d.msg);
  int64_t v = 0;
  assert_int_equal(sp_model_config_int(m, "n_head", &v), 0);
  assert_int_equal(v, 3);
  assert_int_equal(sp_model_config_int(m, "layer_norm_epsilon", &v), SP_ENOENT);
  sp_model_free(m);
  static const char bad[] =
      "{\"format\":\"shardplane.model/v1\",\"name\":\"c\",\"modules\":"
      "[{\"fqn\":\"\",\"type\":\"Net\"}],\"params\":[],\"config\":[1]}";
  assert_int_equal(sp_model_load_string(bad, strlen(bad), "c.json", &m, &d),
                   SP_EFORMAT);
  assert_non_null(strstr(d.msg, "config"));
}

/* A spec with one module, parameterised by the params/buffers/tied parts. */
typedef struct bad_case {
  const char *json;
  int err;
  const char *expect[3]; /* substrings of the message */
} bad_case;

#define HEAD "{\"format\":\"shardplane.model/v1\",\"name\":\"t\","
#define MODS                                                              \
  "\"modules\":[{\"fqn\":\"\",\"type\":\"Net\"},{\"fqn\":\"a\",\"type\":" \
  "\"Linear\"}],"
#define P(fqn, shape, dtype)                                    \
  "{\"fqn\":\"" fqn "\",\"shape\":" shape ",\"dtype\":\"" dtype \
  "\",\"requires_grad\":true}"

static const bad_case k_bad[] = {
    {"[1,2]", SP_EFORMAT, {"spec.json", "top level"}},
    {"{\"format\":\"other\"}", SP_EFORMAT, {"format", "shardplane.model/v1"}},
    {"{\"modules\": [", SP_EFORMAT, {"spec.json:1:", "invalid JSON"}},
    {HEAD "\"params\":[]}", SP_EFORMAT, {"modules", "missing"}},
    {HEAD "\"modules\":[],\"params\":[]}", SP_EFORMAT, {"modules", "empty"}},
    {HEAD "\"modules\":[{\"fqn\":\"a\",\"type\":\"X\"}],\"params\":[]}",
     SP_EFORMAT,
     {"modules[0].fqn", "root"}},
    {HEAD "\"modules\":[{\"fqn\":\"\",\"type\":\"X\"},{\"fqn\":\"a.b\","
          "\"type\":\"X\"}],\"params\":[]}",
     SP_EFORMAT,
     {"modules[1].fqn", "parent module \"a\""}},
    {HEAD "\"modules\":[{\"fqn\":\"\",\"type\":\"X\"},{\"fqn\":\"a\","
          "\"type\":\"X\"},{\"fqn\":\"b\",\"type\":\"X\"},{\"fqn\":\"a.c\","
          "\"type\":\"X\"}],\"params\":[]}",
     SP_EFORMAT,
     {"modules[3].fqn", "named_modules order"}},
    {HEAD "\"modules\":[{\"fqn\":\"\",\"type\":\"X\"},{\"fqn\":\"a\","
          "\"type\":\"X\"},{\"fqn\":\"a\",\"type\":\"Y\"}],\"params\":[]}",
     SP_EFORMAT,
     {"modules[2].fqn", "duplicate FQN \"a\""}},
    {HEAD "\"modules\":[{\"fqn\":\"\"}],\"params\":[]}",
     SP_EFORMAT,
     {"modules[0].type", "missing"}},
    {HEAD MODS "\"params\":[" P("a.w", "[2,3]", "float32") "," P(
         "a.b", "[3]", "float33") "]}",
     SP_EFORMAT,
     {"params[1].dtype", "unknown dtype \"float33\""}},
    {HEAD MODS "\"params\":[" P("a.w", "[2,-3]", "float32") "]}",
     SP_EFORMAT,
     {"params[0].shape[1]", "negative"}},
    {HEAD MODS "\"params\":[" P("a.w", "[2,1.5]", "float32") "]}",
     SP_EFORMAT,
     {"params[0].shape[1]", "not an integer"}},
    {HEAD MODS "\"params\":[" P("a.w", "\"2\"", "float32") "]}",
     SP_EFORMAT,
     {"params[0].shape", "array"}},
    {HEAD MODS "\"params\":[" P("a.w", "[1,1,1,1,1,1,1,1,1]", "float32") "]}",
     SP_ETOOBIG,
     {"params[0].shape", "dimensions"}},
    {HEAD MODS
     "\"params\":[" P("a.w", "[1099511627776,1099511627776]", "float32") "]}",
     SP_ETOOBIG,
     {"params[0].shape", "elements"}},
    {HEAD MODS "\"params\":[" P("a.w", "[2]", "float32") "," P("a.w", "[2]",
                                                               "float32") "]}",
     SP_EFORMAT,
     {"params[1].fqn", "duplicate FQN \"a.w\""}},
    {HEAD MODS "\"params\":[" P("b.w", "[2]", "float32") "]}",
     SP_EFORMAT,
     {"params[0].fqn", "module \"b\" of parameter \"b.w\" is not in modules"}},
    {HEAD MODS "\"params\":[" P("a.steps", "[2]", "int64") "]}",
     SP_EFORMAT,
     {"params[0].dtype", "integer dtype int64", "cannot be flattened"}},
    {HEAD MODS "\"params\":[{\"fqn\":\"a.w\",\"shape\":[2],\"dtype\":"
               "\"float32\",\"requires_grad\":1}]}",
     SP_EFORMAT,
     {"params[0].requires_grad", "true or false"}},
    {HEAD MODS "\"params\":[],\"buffers\":[{\"fqn\":\"x.rm\",\"shape\":[2],"
               "\"dtype\":\"float32\"}]}",
     SP_EFORMAT,
     {"buffers[0].fqn", "module \"x\""}},
    {HEAD MODS "\"params\":[" P(
         "a.w", "[2]",
         "float32") "],\"buffers\":[{"
                    "\"fqn\":\"a.w\",\"shape\":[2],\"dtype\":\"float32\"}]}",
     SP_EFORMAT,
     {"buffers[0].fqn", "duplicate", "already a parameter"}},
    {HEAD MODS "\"params\":[],\"buffers\":[{\"fqn\":\"a.n\",\"shape\":[],"
               "\"dtype\":\"complex64\"}]}",
     SP_EFORMAT,
     {"buffers[0].dtype", "complex64"}},
    {HEAD MODS "\"params\":[" P("a.w", "[2]",
                                "float32") "],\"tied\":[{"
                                           "\"fqn\":\"a.v\",\"to\":\"a.zz\"}]}",
     SP_EFORMAT,
     {"tied[0].to", "\"a.zz\" is not a parameter"}},
    {HEAD MODS "\"params\":[" P("a.w", "[2]",
                                "float32") "],\"tied\":[{"
                                           "\"fqn\":\"q.v\",\"to\":\"a.w\"}]}",
     SP_EFORMAT,
     {"tied[0].fqn", "module \"q\""}},
    {HEAD MODS "\"params\":[" P("a.", "[2]", "float32") "]}",
     SP_EFORMAT,
     {"params[0].fqn", "ends with '.'"}},
    {HEAD MODS "\"params\":[], \"params\":[]}",
     SP_EFORMAT,
     {"invalid JSON", "duplicate"}},
};

static void test_bad_specs(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
    const bad_case *c = &k_bad[i];
    sp_model *m = NULL;
    sp_diag d = {""};
    int rc =
        sp_model_load_string(c->json, strlen(c->json), "spec.json", &m, &d);
    if (rc != c->err)
      fail_msg("case %zu: rc %s (%s), want %s", i, sp_err_name(rc), d.msg,
               sp_err_name(c->err));
    assert_null(m);
    if (strncmp(d.msg, "spec.json", 9) != 0)
      fail_msg("case %zu: message does not name the file: %s", i, d.msg);
    for (int k = 0; k < 3 && c->expect[k] != NULL; k++)
      if (strstr(d.msg, c->expect[k]) == NULL)
        fail_msg("case %zu: message \"%s\" lacks \"%s\"", i, d.msg,
                 c->expect[k]);
  }
}

static void test_defaults_and_aliases(void **state) {
  (void)state;
  const char *json = HEAD MODS
      "\"params\":[{\"fqn\":\"a.w\",\"shape\":[],\"dtype\":"
      "\"torch.half\"}],\"buffers\":[{\"fqn\":\"a.n\",\"shape\":"
      "[0,4],\"dtype\":\"long\",\"persistent\":false}]}";
  sp_model *m = NULL;
  sp_diag d = {""};
  assert_int_equal(sp_model_load_string(json, strlen(json), NULL, &m, &d), 0);
  assert_int_equal(m->params[0].dtype, SP_FLOAT16);
  assert_true(m->params[0].flag); /* requires_grad defaults to true */
  assert_int_equal(m->params[0].numel, 1);
  assert_int_equal(m->buffers[0].dtype, SP_INT64);
  assert_false(m->buffers[0].flag);
  assert_int_equal(m->buffers[0].numel, 0);
  assert_string_equal(m->path, "<string>");
  sp_model_free(m);
}

static void test_file_errors(void **state) {
  (void)state;
  sp_model *m = NULL;
  sp_diag d = {""};
  assert_int_equal(sp_model_load_file("/nonexistent/x.json", &m, &d), SP_EIO);
  assert_non_null(strstr(d.msg, "/nonexistent/x.json"));
  char *dir = sp_test_mkdtemp();
  assert_int_equal(sp_model_load_file(dir, &m, &d), SP_EIO);
  assert_non_null(strstr(d.msg, "not a regular file"));
  char *p = sp_test_path(dir, "empty.json");
  sp_test_write_file(p, "", 0);
  assert_int_equal(sp_model_load_file(p, &m, &d), SP_EFORMAT);
  assert_non_null(strstr(d.msg, "empty.json"));
  assert_null(m);
  sp_test_rmtree(dir);
  free(p);
  free(dir);
}

/* Random truncations and byte flips of a real spec never crash and either
 * load or fail with a message. */
static void test_mutations_do_not_crash(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/models/gpt2.json", SP_EXAMPLES);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  static char buf[1 << 16];
  size_t len = fread(buf, 1, sizeof buf, f);
  fclose(f);
  sp_test_rng rng = {42};
  static char mut[1 << 16];
  for (int iter = 0; iter < 300; iter++) {
    memcpy(mut, buf, len);
    size_t n = len;
    if (iter % 3 == 0) n = (size_t)sp_test_rng_below(&rng, len);
    int flips = 1 + (int)sp_test_rng_below(&rng, 4);
    for (int k = 0; k < flips && n > 0; k++)
      mut[sp_test_rng_below(&rng, n)] = (char)sp_test_rng_next(&rng);
    sp_model *m = NULL;
    sp_diag d = {""};
    int rc = sp_model_load_string(mut, n, "mut.json", &m, &d);
    if (rc == 0)
      sp_model_free(m);
    else
      assert_true(strlen(d.msg) > 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_real_specs_load),
      cmocka_unit_test(test_resnet_details),
      cmocka_unit_test(test_gpt2_tied),
      cmocka_unit_test(test_gpt2_family),
      cmocka_unit_test(test_bad_specs),
      cmocka_unit_test(test_defaults_and_aliases),
      cmocka_unit_test(test_file_errors),
      cmocka_unit_test(test_mutations_do_not_crash),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
