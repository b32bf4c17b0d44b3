/* `shardplane store`: get (optionally waiting), set, add, delete and
 * compare-and-set on the coordinator's key-value store. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* ------------------------------------------------------------------ */
/* store                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_store = {
    "store get KEY [--wait] | set KEY VALUE | add KEY DELTA | delete KEY |\n"
    "                  cas KEY EXPECTED DESIRED | cas --absent KEY DESIRED "
    "[options]",
    "The coordinator's key-value store, which workers bootstrap their\n"
    "collectives through.\n\n"
    "  get KEY                      print the value (exit 3 when absent);\n"
    "                               values that are not text print as hex\n"
    "    --wait                     wait for KEY to appear, up to "
    "--timeout-ms\n"
    "                               (exit 3 when it does not in time)\n"
    "  set KEY VALUE                store VALUE\n"
    "  add KEY DELTA                add DELTA to the decimal integer in KEY\n"
    "                               (absent: 0), print the sum; a negative\n"
    "                               DELTA goes after --: add KEY -- -1\n"
    "  delete KEY                   remove KEY (exit 3 when absent)\n"
    "  cas KEY EXPECTED DESIRED     store DESIRED if KEY holds EXPECTED\n"
    "    --absent                   ... if KEY does not exist (then: cas\n"
    "                               --absent KEY DESIRED); exit 1 when the\n"
    "                               value was not swapped\n"
    "The options go anywhere before \"--\": store --coordinator ADDR add\n"
    "KEY -- -1.\n\n",
    0, 64, NULL};

enum { OPT_S_WAIT = 256, OPT_S_ABSENT };

typedef struct store_args {
  bool wait, absent;
} store_args;

static int store_opt(void *ctx, int c, const char *arg) {
  (void)arg;
  store_args *a = ctx;
  if (c == OPT_S_WAIT)
    a->wait = true;
  else if (c == OPT_S_ABSENT)
    a->absent = true;
  else
    return -1;
  return 0;
}

/* Text prints as it is; anything else (an NCCL unique id) as hex, so that
 * a terminal never receives raw bytes. */
static bool is_text(const ProtobufCBinaryData *v) {
  for (size_t i = 0; i < v->len; i++)
    if ((v->data[i] < 0x20 && v->data[i] != '\t' && v->data[i] != '\n') ||
        v->data[i] == 0x7f)
      return false;
  json_t *s = json_stringn((const char *)v->data, v->len); /* UTF-8? */
  json_decref(s);
  return s != NULL;
}

static void print_value(const ProtobufCBinaryData *v) {
  if (is_text(v)) {
    fwrite(v->data, 1, v->len, stdout);
  } else {
    printf("(%zu bytes, not text) ", v->len);
    for (size_t i = 0; i < v->len; i++) printf("%02x", v->data[i]);
  }
  putchar('\n');
}

/* "value" for text, "value_hex" for anything else. */
static void set_value_json(json_t *o, const ProtobufCBinaryData *v) {
  if (is_text(v)) {
    json_object_set_new(o, "value",
                        json_stringn((const char *)v->data, v->len));
    return;
  }
  char *hex = malloc(2 * v->len + 1);
  if (hex == NULL) return;
  for (size_t i = 0; i < v->len; i++)
    snprintf(hex + 2 * i, 3, "%02x", v->data[i]);
  hex[2 * v->len] = '\0';
  json_object_set_new(o, "value_hex", json_string(hex));
  free(hex);
}

static ProtobufCBinaryData bytes_of(const char *s) {
  return (ProtobufCBinaryData){strlen(s), (uint8_t *)s};
}

static int json_done(json_t *o, int ec) {
  if (sp_render_json_out(o) != 0 && ec == SP_EXIT_OK) return SP_EXIT_FAILURE;
  return ec;
}

static int store_get(sp_remote *r, const char *key, bool wait) {
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  q.wait = wait;
  ProtobufCMessage *m;
  sp_rpc_status st;
  int ec = sp_remote_call_status(
      r, SP_COORD_PATH("StoreGet"), &q.base,
      &shardplane__v1__store_get_response__descriptor, r->timeout_ms, &m, &st);
  if (ec != PROCEED) return ec;
  /* A wait that runs out means the key is not there: "not found", the
   * same answer as a get without --wait, so scripts test one code. */
  if (wait && st.code == SP_RPC_DEADLINE_EXCEEDED) {
    sp_cli_error(r->cmd, "no key \"%s\" within %" PRIu64 " ms (%s)", key,
                 r->timeout_ms, sp_rpc_code_name(st.code));
    return SP_EXIT_NOT_FOUND;
  }
  if (st.code != SP_RPC_OK) return sp_remote_fail_status(r, &st);
  const Shardplane__V1__StoreGetResponse *g =
      (const Shardplane__V1__StoreGetResponse *)m;
  if (!g->found) {
    sp_cli_error(r->cmd, "no key \"%s\"", key);
    ec = SP_EXIT_NOT_FOUND;
  } else if (r->json) {
    json_t *o =
        json_pack("{s:s,s:I}", "key", key, "version", (json_int_t)g->version);
    if (o != NULL) set_value_json(o, &g->value);
    ec = json_done(o, SP_EXIT_OK);
  } else {
    print_value(&g->value);
    ec = SP_EXIT_OK;
  }
  sp_remote_free_msg(m);
  return ec;
}

static int store_set(sp_remote *r, const char *key, const char *value) {
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.value = bytes_of(value);
  ProtobufCMessage *m;
  int ec = sp_remote_call(r, SP_COORD_PATH("StoreSet"), &q.base,
                          &shardplane__v1__store_set_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  uint64_t version = ((Shardplane__V1__StoreSetResponse *)m)->version;
  sp_remote_free_msg(m);
  if (r->json)
    return json_done(
        json_pack("{s:s,s:I}", "key", key, "version", (json_int_t)version),
        SP_EXIT_OK);
  printf("stored \"%s\" (version %" PRIu64 ")\n", key, version);
  return SP_EXIT_OK;
}

static int store_add(sp_remote *r, const char *key, const char *delta_s) {
  char *end;
  errno = 0;
  long long delta = strtoll(delta_s, &end, 10);
  if (delta_s[0] == '\0' || *end != '\0' || errno != 0) {
    sp_cli_error(r->cmd, "add: DELTA must be a 64-bit integer, got \"%s\"",
                 delta_s);
    return SP_EXIT_USAGE;
  }
  Shardplane__V1__StoreAddRequest q = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  q.key = (char *)key;
  q.delta = delta;
  ProtobufCMessage *m;
  int ec = sp_remote_call(r, SP_COORD_PATH("StoreAdd"), &q.base,
                          &shardplane__v1__store_add_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  const Shardplane__V1__StoreAddResponse *a =
      (const Shardplane__V1__StoreAddResponse *)m;
  if (r->json)
    ec = json_done(
        json_pack("{s:s,s:I,s:I}", "key", key, "value", (json_int_t)a->value,
                  "version", (json_int_t)a->version),
        SP_EXIT_OK);
  else
    printf("%" PRId64 "\n", a->value); /* alone, for n=$(shardplane ...) */
  sp_remote_free_msg(m);
  return ec;
}

static int store_delete(sp_remote *r, const char *key) {
  Shardplane__V1__StoreDeleteRequest q =
      SHARDPLANE__V1__STORE_DELETE_REQUEST__INIT;
  q.key = (char *)key;
  ProtobufCMessage *m;
  int ec =
      sp_remote_call(r, SP_COORD_PATH("StoreDelete"), &q.base,
                     &shardplane__v1__store_delete_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  bool deleted = ((Shardplane__V1__StoreDeleteResponse *)m)->deleted;
  sp_remote_free_msg(m);
  ec = deleted ? SP_EXIT_OK : SP_EXIT_NOT_FOUND;
  if (!deleted) sp_cli_error(r->cmd, "no key \"%s\"", key);
  if (r->json)
    return json_done(json_pack("{s:s,s:b}", "key", key, "deleted", deleted),
                     ec);
  if (deleted) printf("deleted \"%s\"\n", key);
  return ec;
}

static int store_cas(sp_remote *r, const char *key, const char *expected,
                     const char *desired) {
  Shardplane__V1__StoreCompareSetRequest q =
      SHARDPLANE__V1__STORE_COMPARE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.expect_absent = expected == NULL;
  if (expected != NULL) q.expected = bytes_of(expected);
  q.desired = bytes_of(desired);
  ProtobufCMessage *m;
  int ec = sp_remote_call(
      r, SP_COORD_PATH("StoreCompareSet"), &q.base,
      &shardplane__v1__store_compare_set_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  const Shardplane__V1__StoreCompareSetResponse *c =
      (const Shardplane__V1__StoreCompareSetResponse *)m;
  ec = c->swapped ? SP_EXIT_OK : SP_EXIT_FAILURE;
  if (!c->swapped)
    sp_cli_error(r->cmd, "\"%s\" was not swapped: %s", key,
                 c->found ? "it holds another value" : "it does not exist");
  if (r->json) {
    json_t *o =
        json_pack("{s:s,s:b,s:b,s:I}", "key", key, "swapped", c->swapped,
                  "found", c->found, "version", (json_int_t)c->version);
    if (o != NULL && c->found) set_value_json(o, &c->value);
    ec = json_done(o, ec);
  } else if (c->swapped) {
    printf("swapped \"%s\" (version %" PRIu64 ")\n", key, c->version);
  } else if (c->found) {
    print_value(&c->value); /* what it holds instead */
  }
  sp_remote_free_msg(m);
  return ec;
}

/* The operations and the words each takes after it. */
static const struct store_op {
  const char *name;
  const char *args[3];
} k_ops[] = {{"get", {"KEY"}},
             {"set", {"KEY", "VALUE"}},
             {"add", {"KEY", "DELTA"}},
             {"delete", {"KEY"}},
             {"cas", {"KEY", "EXPECTED", "DESIRED"}}};

/* The operation's words checked against what it takes, each fault in a
 * line naming it. Returns PROCEED or the exit code. */
static int check_op(const sp_remote *r, const struct store_op *op,
                    const store_args *a, char **args, size_t n) {
  static const char *const absent_args[3] = {"KEY", "DESIRED"};
  bool cas = strcmp(op->name, "cas") == 0;
  const char *const *want = cas && a->absent ? absent_args : op->args;
  size_t n_want = 0;
  char usage[64];
  int len = snprintf(usage, sizeof usage, "store %s%s", op->name,
                     cas && a->absent ? " --absent" : "");
  for (; n_want < 3 && want[n_want] != NULL; n_want++)
    len +=
        snprintf(usage + len, sizeof usage - (size_t)len, " %s", want[n_want]);
  if (a->wait && strcmp(op->name, "get") != 0)
    sp_cli_error(r->cmd, "%s: --wait is an option of get", op->name);
  else if (a->absent && !cas)
    sp_cli_error(r->cmd, "%s: --absent is an option of cas", op->name);
  else if (n < n_want)
    sp_cli_error(r->cmd, "%s: missing %s (%s)", op->name, want[n], usage);
  else if (n > n_want && strncmp(args[n_want], "--", 2) == 0)
    /* getopt left it a word: it came after "--" */
    sp_cli_error(r->cmd,
                 "%s: unexpected argument \"%s\": after \"--\" "
                 "every word is an argument; options go before \"--\"",
                 op->name, args[n_want]);
  else if (n > n_want)
    sp_cli_error(r->cmd, "%s: unexpected argument \"%s\" (%s)", op->name,
                 args[n_want], usage);
  else
    return PROCEED;
  sp_cli_try_help(r->cmd);
  return SP_EXIT_USAGE;
}

int sp_cmd_store(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "store");
  store_args a = {false, false};
  const struct option own[] = {{"wait", no_argument, NULL, OPT_S_WAIT},
                               {"absent", no_argument, NULL, OPT_S_ABSENT}};
  int first;
  size_t n;
  /* the options anywhere before "--", before the operation too (store
   * --coordinator ADDR add KEY -- -1) */
  int ec = sp_remote_parse_args(&r, &k_store, argc, argv, own, 2, store_opt, &a,
                                &first, &n);
  if (ec != PROCEED) return ec;
  if (n == 0) {
    sp_cli_error(r.cmd,
                 "missing the operation: get, set, add, delete or "
                 "cas");
    sp_cli_try_help(r.cmd);
    return SP_EXIT_USAGE;
  }
  const char *name = argv[first];
  const struct store_op *op = NULL;
  for (size_t i = 0; i < sizeof k_ops / sizeof k_ops[0]; i++)
    if (strcmp(k_ops[i].name, name) == 0) op = &k_ops[i];
  if (op == NULL) {
    sp_cli_error(r.cmd,
                 "unknown operation \"%s\" (get, set, add, delete, "
                 "cas)",
                 name);
    sp_cli_try_help(r.cmd);
    return SP_EXIT_USAGE;
  }
  char **args = argv + first + 1;
  n--;
  if ((ec = check_op(&r, op, &a, args, n)) != PROCEED) return ec;
  if (strcmp(name, "get") == 0)
    ec = store_get(&r, args[0], a.wait);
  else if (strcmp(name, "set") == 0)
    ec = store_set(&r, args[0], args[1]);
  else if (strcmp(name, "add") == 0)
    ec = store_add(&r, args[0], args[1]);
  else if (strcmp(name, "delete") == 0)
    ec = store_delete(&r, args[0]);
  else
    ec = store_cas(&r, args[0], a.absent ? NULL : args[1], args[n - 1]);
  return sp_remote_finish(&r, ec);
}
