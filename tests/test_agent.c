/* `shardplane agent` with real processes on loopback: two agents of two
 * workers each train the reference MLP to the very checkpoint `shardplane
 * run --nproc 4` writes, their workers' control traffic carried over one
 * connection per agent; the launcher's variables, prefixes and exit
 * codes; a worker killed mid-training named with its rank and signal;
 * agents that ride out their coordinator's SIGKILL and restart, and one
 * that gives up on a coordinator that never comes back; bad usage named
 * by its flag. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "base/proc.h"
#include "rpc/rpc.h"
#include "rpc/rpc_cred.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "support/auth_fixture.h"
#include "support/job_fixture.h"
#include "support/netns_fixture.h"
#include "support/testutil.h"

#define SHARDPLANE SP_BIN_DIR "/shardplane"
#define WORKER SP_BIN_DIR "/shardplane-worker"
#define MLP SP_EXAMPLES "/mlp.json"

/* A coordinator of a world of `world` ranks listening on `listen`, with
 * the tokens of auth and more flags (NULL-terminated). */
static void start_coord_flags(sp_proc *c, sp_tauth *auth, int world,
                              const char *listen, const char *const *flags,
                              char *addr, size_t cap) {
  char ws[16];
  snprintf(ws, sizeof ws, "%d", world);
  char *argv[32] = {SP_BIN_DIR "/shardplane-coordinator",
                    "--listen",
                    (char *)listen,
                    "--model",
                    MLP,
                    "--world-size",
                    ws,
                    "--insecure",
                    "--token-file",
                    auth->token_file,
                    "--quiet"};
  size_t k = 11;
  for (size_t i = 0; flags[i] && k < 31; i++) argv[k++] = (char *)flags[i];
  argv[k] = NULL;
  sp_diag d = {{0}};
  if (sp_proc_spawn(c, argv, false, true, "listening on 127.0.0.1:%d", &d))
    fail_msg("coordinator: %s", d.msg);
  snprintf(addr, cap, "127.0.0.1:%d", c->port);
}

/* The same with a state dir, or none (NULL). */
static void start_coord_at(sp_proc *c, sp_tauth *auth, int world,
                           const char *listen, const char *state_dir,
                           char *addr, size_t cap) {
  const char *flags[] = {state_dir ? "--state-dir" : NULL, state_dir, NULL};
  start_coord_flags(c, auth, world, listen, flags, addr, cap);
}

static void start_coord(sp_proc *c, sp_tauth *auth, int world, char *addr,
                        size_t cap) {
  start_coord_at(c, auth, world, "127.0.0.1:0", NULL, addr, cap);
}

/* `shardplane agent --coordinator addr --insecure --token-file (worker)
 * --nproc-per-node 2 [--node-rank node] -- trainer...`, its output in
 * dir/STEM.out and .err. node NULL: no --node-rank. */
static pid_t spawn_agent(const char *dir, const char *stem, const char *addr,
                         const sp_tauth *auth, const char *node,
                         const char *const *extra, const char *const *trainer) {
  char *argv[64], name[64];
  size_t k = 0;
  argv[k++] = SHARDPLANE;
  argv[k++] = "agent";
  argv[k++] = "--coordinator";
  argv[k++] = (char *)addr;
  argv[k++] = "--insecure";
  argv[k++] = "--token-file";
  argv[k++] = auth->file[SP_ROLE_WORKER];
  argv[k++] = "--nproc-per-node";
  argv[k++] = "2";
  if (node != NULL) {
    argv[k++] = "--node-rank";
    argv[k++] = (char *)node;
  }
  for (size_t i = 0; extra && extra[i]; i++) argv[k++] = (char *)extra[i];
  argv[k++] = "--";
  for (size_t i = 0; trainer[i]; i++) argv[k++] = (char *)trainer[i];
  argv[k] = NULL;
  snprintf(name, sizeof name, "%s.out", stem);
  char *out = sp_test_path(dir, name);
  snprintf(name, sizeof name, "%s.err", stem);
  char *err = sp_test_path(dir, name);
  pid_t pid = sp_test_spawn_logged(out, err, argv);
  free(out);
  free(err);
  return pid;
}

/* The same, its output in dir/agentNODE.out and .err; node < 0: no
 * --node-rank (agent9.out). */
static pid_t start_agent(const char *dir, const char *addr,
                         const sp_tauth *auth, int node,
                         const char *const *extra, const char *const *trainer) {
  char ns[16], stem[32];
  snprintf(ns, sizeof ns, "%d", node);
  snprintf(stem, sizeof stem, "agent%d", node < 0 ? 9 : node);
  return spawn_agent(dir, stem, addr, auth, node >= 0 ? ns : NULL, extra,
                     trainer);
}

/* Each test's scratch directory, the job's tokens and, for most, a
 * coordinator of 4 ranks on loopback; the teardown also runs after a
 * failed test, so nothing it started is left behind. */
typedef struct fx {
  char *dir;
  sp_tauth auth;
  sp_proc coord;
  char addr[64];
} fx;

static int fx_setup_bare(void **state) {
  fx *f = calloc(1, sizeof *f);
  if (f == NULL) return -1;
  f->dir = sp_test_mkdtemp();
  sp_tauth_make(&f->auth);
  *state = f;
  return 0;
}

static int fx_setup(void **state) {
  fx_setup_bare(state);
  fx *f = *state;
  start_coord(&f->coord, &f->auth, 4, f->addr, sizeof f->addr);
  return 0;
}

/* sp_proc_stop leaves the pid of the child it reaped: cleared here, so
 * the teardown never signals a pid the system may have given another
 * process since. */
static void stop_coord(fx *f) {
  if (f->coord.pid > 0) sp_proc_stop(&f->coord, 5000);
  f->coord.pid = 0;
}

/* SIGKILL, as a crash: nothing written on the way out. */
static void kill9_coord(fx *f) {
  assert_true(f->coord.pid > 0);
  assert_int_equal(kill(f->coord.pid, SIGKILL), 0);
  waitpid(f->coord.pid, NULL, 0);
  f->coord.pid = 0;
}

static int fx_teardown(void **state) {
  fx *f = *state;
  stop_coord(f);
  sp_tauth_free(&f->auth);
  sp_test_rmtree(f->dir);
  free(f->dir);
  free(f);
  return 0;
}

static char *slurp(const char *dir, const char *name) {
  char *path = sp_test_path(dir, name);
  char *s = sp_test_read_file(path);
  free(path);
  return s;
}

/* A client of the coordinator with the token of a role. */
static sp_rpc_sync *client(const char *addr, const sp_tauth *auth, int role) {
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000,
                          .token = auth->token[role]};
  sp_rpc_sync *c = NULL;
  assert_int_equal(sp_rpc_sync_open_opts(addr, &o, &c), 0);
  return c;
}

/* One call with a reader's token, which must succeed: the answer (the
 * caller frees it). */
static ProtobufCMessage *ask(const char *addr, const sp_tauth *auth,
                             const char *method, const ProtobufCMessage *q,
                             const ProtobufCMessageDescriptor *reply) {
  sp_rpc_sync *c = client(addr, auth, SP_ROLE_READER);
  char path[128];
  snprintf(path, sizeof path, "/shardplane.v1.Coordinator/%s", method);
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(sp_rpc_sync_unary(c, path, q, reply, 5000, &resp, &st), 0);
  if (st.code != SP_RPC_OK) fail_msg("%s: %s", method, st.message);
  sp_rpc_sync_close(c);
  return resp;
}

static Shardplane__V1__ListIncarnationsResponse *incarnations(
    const char *addr, const sp_tauth *auth) {
  Shardplane__V1__ListIncarnationsRequest q =
      SHARDPLANE__V1__LIST_INCARNATIONS_REQUEST__INIT;
  return (Shardplane__V1__ListIncarnationsResponse *)ask(
      addr, auth, "ListIncarnations", &q.base,
      &shardplane__v1__list_incarnations_response__descriptor);
}

/* A job restarted once (of --max-restarts 1), incarnation 0 ended by
 * rank 3's SIGKILL. */
static void expect_restarted_after_rank3(
    const Shardplane__V1__ListIncarnationsResponse *li) {
  assert_int_equal(li->current, 1);
  assert_int_equal(li->restarts, 1);
  assert_int_equal(li->max_restarts, 1);
  assert_int_equal(li->n_incarnations, 2);
  assert_true(li->incarnations[0]->ended);
  assert_int_equal(li->incarnations[0]->rank, 3);
  assert_int_equal(li->incarnations[0]->signal, SIGKILL);
}

/* StoreSet key=value as a worker would; StoreGet's status and, when
 * found, whether the value is `value`. */
static void store_set(const char *addr, const sp_tauth *auth, const char *key,
                      const char *value) {
  sp_rpc_sync *c = client(addr, auth, SP_ROLE_WORKER);
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.value.data = (uint8_t *)value;
  q.value.len = strlen(value);
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(c, "/shardplane.v1.Coordinator/StoreSet", &q.base,
                        &shardplane__v1__store_set_response__descriptor, 5000,
                        &resp, &st),
      0);
  assert_int_equal(st.code, SP_RPC_OK);
  protobuf_c_message_free_unpacked(resp, NULL);
  sp_rpc_sync_close(c);
}

static bool store_has(const char *addr, const sp_tauth *auth, const char *key) {
  sp_rpc_sync *c = client(addr, auth, SP_ROLE_WORKER);
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(c, "/shardplane.v1.Coordinator/StoreGet", &q.base,
                        &shardplane__v1__store_get_response__descriptor, 5000,
                        &resp, &st),
      0);
  bool found =
      st.code == SP_RPC_OK && ((Shardplane__V1__StoreGetResponse *)resp)->found;
  if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  sp_rpc_sync_close(c);
  return found;
}

/* ---- the agents' protocol, spoken by the test ---- */

/* An AgentSession registered as reg says. */
static sp_rpc_sync_stream *agent_open_reg(
    sp_rpc_sync *c, const Shardplane__V1__AgentRegister *reg) {
  sp_rpc_sync_stream *st = NULL;
  assert_int_equal(
      sp_rpc_sync_stream_open(c, "/shardplane.v1.Coordinator/AgentSession", 0,
                              NULL, 0, &st),
      0);
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.register_ = (Shardplane__V1__AgentRegister *)reg;
  assert_int_equal(sp_rpc_sync_stream_send(st, &up.base), 0);
  return st;
}

/* An agent of host "test", pid 0: registering (inc < 0) or, from inc,
 * registering again after its stream broke. */
static sp_rpc_sync_stream *agent_open_as(sp_rpc_sync *c, uint32_t node,
                                         uint32_t nproc, uint32_t max_restarts,
                                         int inc, bool stopped, uint32_t pid) {
  Shardplane__V1__AgentRegister reg = SHARDPLANE__V1__AGENT_REGISTER__INIT;
  reg.node_rank = node;
  reg.nproc = nproc;
  reg.max_restarts = max_restarts;
  reg.host = "test";
  reg.pid = pid;
  reg.rejoin = inc >= 0;
  reg.incarnation = inc >= 0 ? (uint64_t)inc : 0;
  reg.stopped = stopped;
  return agent_open_reg(c, &reg);
}

static sp_rpc_sync_stream *agent_open(sp_rpc_sync *c, uint32_t node,
                                      uint32_t nproc, uint32_t max_restarts) {
  return agent_open_as(c, node, nproc, max_restarts, -1, false, 0);
}

/* The next command, which must be `cmd` for incarnation `inc`; its reason
 * is copied to why (when given). */
static void expect_cmd(sp_rpc_sync_stream *st, int cmd, uint64_t inc, char *why,
                       size_t cap) {
  ProtobufCMessage *m = NULL;
  sp_rpc_status status;
  int rc = sp_rpc_sync_stream_recv(st, &shardplane__v1__agent_down__descriptor,
                                   10000, &m, &status);
  if (rc != 0) fail_msg("no AgentDown: %d %s", rc, status.message);
  Shardplane__V1__AgentDown *d = (Shardplane__V1__AgentDown *)m;
  assert_int_equal(d->command, cmd);
  assert_int_equal(d->incarnation, inc);
  if (why) snprintf(why, cap, "%s", d->reason);
  protobuf_c_message_free_unpacked(m, NULL);
}

/* The stream's end, which must be `code`; its message copied to why. */
static void expect_end(sp_rpc_sync_stream *st, int code, char *why,
                       size_t cap) {
  ProtobufCMessage *m = NULL;
  sp_rpc_status status;
  assert_int_equal(
      sp_rpc_sync_stream_recv(st, &shardplane__v1__agent_down__descriptor,
                              10000, &m, &status),
      SP_ENOENT);
  assert_int_equal(status.code, code);
  snprintf(why, cap, "%s", status.message);
}

/* A worker's death (rank >= 0) or, with rank < 0, "stopped". */
static void agent_send(sp_rpc_sync_stream *st, uint64_t inc, int rank,
                       int exit_code, int sig) {
  Shardplane__V1__WorkerExit w = SHARDPLANE__V1__WORKER_EXIT__INIT;
  w.incarnation = inc;
  w.rank = rank < 0 ? 0 : (uint32_t)rank;
  w.exit_code = exit_code;
  w.signal = sig;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  if (rank >= 0) {
    up.worker_exit = &w;
  } else {
    up.stopped = true;
    up.incarnation = inc;
  }
  assert_int_equal(sp_rpc_sync_stream_send(st, &up.base), 0);
}

/* Established TCP connections whose far end is 127.0.0.1:port: the
 * clients' side of connections to the coordinator, whoever holds them. */
static int conns_to(int port) {
  FILE *f = fopen("/proc/net/tcp", "r");
  if (!f) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f)) {
    unsigned la, lp, ra, rp, st;
    if (sscanf(line, " %*d: %x:%x %x:%x %x", &la, &lp, &ra, &rp, &st) == 5 &&
        (int)rp == port && st == 1 /* ESTABLISHED */)
      n++;
  }
  fclose(f);
  return n;
}

/* Waits for both agents (killing them after timeout_s) while counting the
 * connections to the coordinator; the largest count seen goes to
 * *max_conns. */
static void wait_agents(pid_t a[2], int st[2], int port, double timeout_s,
                        int *max_conns) {
  double end = sp_clock_s() + timeout_s;
  st[0] = st[1] = -2;
  *max_conns = 0;
  while ((st[0] == -2 || st[1] == -2) && sp_clock_s() < end) {
    int c = conns_to(port);
    if (c > *max_conns) *max_conns = c;
    for (int i = 0; i < 2; i++) {
      int s;
      if (st[i] == -2 && waitpid(a[i], &s, WNOHANG) == a[i])
        st[i] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
    }
    usleep(5000);
  }
  for (int i = 0; i < 2; i++)
    if (st[i] == -2) st[i] = sp_test_wait_exit(a[i], 0);
}

/* `shardplane run --nproc 4` of the same training (steps, global batch 24,
 * lr 0.05), its checkpoint in dir/run, its output in dir/run.out and
 * .err. No [ranks] lines: each is a call of run's own to its coordinator,
 * a second connection test_agents_train_as_run would count whenever the
 * run outlasts the first 10 s (a busy machine, the suite's long tests
 * beside it). */
static pid_t start_reference(const char *dir, const char *steps) {
  char *ck = sp_test_path(dir, "run");
  char *argv[] = {SHARDPLANE,
                  "run",
                  "--nproc",
                  "4",
                  "--model",
                  MLP,
                  "--steps",
                  (char *)steps,
                  "--global-batch",
                  "24",
                  "--lr",
                  "0.05",
                  "--checkpoint-dir",
                  ck,
                  "--ranks-every",
                  "0",
                  NULL};
  char *out = sp_test_path(dir, "run.out"), *err = sp_test_path(dir, "run.err");
  pid_t pid = sp_test_spawn_logged(out, err, argv);
  free(out);
  free(err);
  free(ck);
  return pid;
}

/* Fails unless the FULL checkpoint in ck is, tensor for tensor and byte
 * for byte, the one the reference run wrote in dir/run. */
static void same_as_reference(const char *dir, const char *ck) {
  char *fa = sp_test_path(ck, "full"), *fr = sp_test_path(dir, "run/full");
  sp_tjob_same_tensors(fa, "model.safetensors", fr, "model.safetensors");
  free(fa);
  free(fr);
}

/* Two agents of two workers each against one coordinator train to the
 * same bytes as `shardplane run --nproc 4`, each agent holding one
 * connection to the coordinator for its two workers (each of which opens
 * a Session stream and store connections of its own). */
static void test_agents_train_as_run(void **state) {
  fx *f = *state;
  char *cka = sp_test_path(f->dir, "agents");
  const char *trainer[] = {
      WORKER, "--insecure", "--steps",     "6", "--global-batch",   "24",
      "--lr", "0.05",       "--log-every", "1", "--checkpoint-dir", cka,
      NULL};
  pid_t a[2];
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, NULL, trainer);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 120, &max_conns);
  stop_coord(f);
  char *out0 = slurp(f->dir, "agent0.out"), *err0 = slurp(f->dir, "agent0.err"),
       *err1 = slurp(f->dir, "agent1.err");
  printf(
      "agent 0:\n%s%s\nagent 1:\n%s\nconnections to the coordinator: at "
      "most %d\n",
      out0, err0, err1, max_conns);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  /* rank 0's progress, with its prefix */
  assert_non_null(strstr(out0, "[rank0]: step 6/6"));
  /* every worker reached the coordinator through its agent ... */
  assert_non_null(strstr(err0, "ranks 0-1 of 4"));
  assert_non_null(strstr(err1, "ranks 2-3 of 4"));
  assert_non_null(strstr(err0, "proxied "));
  /* ... and the agents' were the only connections */
  assert_int_equal(max_conns, 2);
  free(out0);
  free(err0);
  free(err1);

  pid_t run = start_reference(f->dir, "6");
  char *out = sp_test_path(f->dir, "run.out");
  /* run is the coordinator and one agent: its 4 workers, one connection */
  int port = 0, run_conns = 0, rst = -2;
  double end = sp_clock_s() + 120;
  while (rst == -2 && sp_clock_s() < end) {
    if (port == 0) {
      char *o = sp_test_read_file(out);
      const char *at = strstr(o, "coordinator on 127.0.0.1:");
      if (at) port = atoi(at + strlen("coordinator on 127.0.0.1:"));
      free(o);
    }
    int c = port ? conns_to(port) : 0;
    if (c > run_conns) run_conns = c;
    int s;
    if (waitpid(run, &s, WNOHANG) == run)
      rst = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
    usleep(5000);
  }
  if (rst == -2) rst = sp_test_wait_exit(run, 0);
  printf(
      "shardplane run --nproc 4: exit %d, at most %d connection(s) to "
      "its coordinator\n",
      rst, run_conns);
  assert_int_equal(rst, 0);
  assert_int_equal(run_conns, 1);
  same_as_reference(f->dir, cka);
  free(out);
  free(cka);
}

/* The same on two hosts for real: each agent in a network namespace of
 * its own, joined by a veth pair, the coordinator beside agent 0. The
 * workers' Gloo connections cross hosts at the address each agent finds
 * toward the coordinator. Needs root and iproute2, else skipped. */
static void test_agents_two_namespaces(void **state) {
  fx *f = *state;
  sp_tnet net = {0};
  char why[256];
  if (sp_tnet_up(&net, why, sizeof why) != 0) {
    printf(
        "SKIPPED: two agents in network namespaces: %s (the loopback "
        "variant runs)\n",
        why);
    skip();
  }
  char *cka = sp_test_path(f->dir, "agents");
  char listen[64], fmt[64], addr[64];
  snprintf(listen, sizeof listen, "%s:0", net.addr[0]);
  snprintf(fmt, sizeof fmt, "listening on %s:%%d", net.addr[0]);
  char *cargv[] = {net.ip,
                   "netns",
                   "exec",
                   net.ns[0],
                   SP_BIN_DIR "/shardplane-coordinator",
                   "--listen",
                   listen,
                   "--model",
                   MLP,
                   "--world-size",
                   "4",
                   "--insecure",
                   "--token-file",
                   f->auth.token_file,
                   "--quiet",
                   NULL};
  sp_diag d = {{0}};
  if (sp_proc_spawn(&f->coord, cargv, false, true, fmt, &d) != 0)
    fail_msg("coordinator: %s", d.msg);
  snprintf(addr, sizeof addr, "%s:%d", net.addr[0], f->coord.port);
  pid_t a[2];
  for (int i = 0; i < 2; i++) {
    char ns[16], out[32], err[32];
    snprintf(ns, sizeof ns, "%d", i);
    char *argv[] = {net.ip,
                    "netns",
                    "exec",
                    net.ns[i],
                    SHARDPLANE,
                    "agent",
                    "--coordinator",
                    addr,
                    "--insecure",
                    "--token-file",
                    f->auth.file[SP_ROLE_WORKER],
                    "--nproc-per-node",
                    "2",
                    "--node-rank",
                    ns,
                    "--",
                    WORKER,
                    "--insecure",
                    "--steps",
                    "6",
                    "--global-batch",
                    "24",
                    "--lr",
                    "0.05",
                    "--log-every",
                    "1",
                    "--checkpoint-dir",
                    cka,
                    NULL};
    snprintf(out, sizeof out, "ns%d.out", i);
    snprintf(err, sizeof err, "ns%d.err", i);
    char *po = sp_test_path(f->dir, out), *pe = sp_test_path(f->dir, err);
    a[i] = sp_test_spawn_logged(po, pe, argv);
    free(po);
    free(pe);
  }
  int st0 = sp_test_wait_exit(a[0], 120), st1 = sp_test_wait_exit(a[1], 120);
  stop_coord(f);
  char *err1 = slurp(f->dir, "ns1.err");
  printf("agent in %s:\n%s", net.ns[1], err1);
  sp_tnet_down(&net);
  assert_int_equal(st0, 0);
  assert_int_equal(st1, 0);
  free(err1);
  assert_int_equal(sp_test_wait_exit(start_reference(f->dir, "6"), 120), 0);
  same_as_reference(f->dir, cka);
  free(cka);
}

/* What a trainer is given, whatever it is: the launcher's variables, its
 * lines prefixed with its rank, its exit code collected and named. */
static void test_agent_env_and_exit_codes(void **state) {
  fx *f = *state;
  const char *show[] = {"/bin/sh", "-c",
                        "echo \"env $RANK $LOCAL_RANK $WORLD_SIZE "
                        "$LOCAL_WORLD_SIZE $GROUP_RANK $NODE_RANK "
                        "$SHARDPLANE_COORDINATOR\"; "
                        "echo \"grace $SHARDPLANE_COORDINATOR_GRACE\"; "
                        "echo oops >&2; "
                        "[ $LOCAL_RANK = 1 ] && exit 3; exit 0",
                        NULL};
  /* the node rank from the environment, as torchrun's launchers set it;
   * the agent's grace is its workers' */
  setenv("NODE_RANK", "1", 1);
  const char *grace[] = {"--coordinator-grace", "2.5", NULL};
  pid_t pid = start_agent(f->dir, f->addr, &f->auth, -1, grace, show);
  unsetenv("NODE_RANK");
  int st = sp_test_wait_exit(pid, 60);
  char *out = slurp(f->dir, "agent9.out"), *err = slurp(f->dir, "agent9.err");
  printf("%s%s", out, err);
  assert_int_equal(st, 1);
  assert_non_null(strstr(out, "[rank2]: env 2 0 4 2 1 1 unix:/"));
  assert_non_null(strstr(out, "[rank3]: env 3 1 4 2 1 1 unix:/"));
  assert_non_null(strstr(out, "[rank3]: grace 2.500\n"));
  assert_non_null(strstr(err, "[rank3]: oops"));
  assert_non_null(strstr(err,
                         "rank 3 (local rank 1 on node 1) exited with "
                         "status 3"));
  assert_null(strstr(err, "rank 2 (local rank 0"));
  free(out);
  free(err);

  /* without the proxy the workers get the coordinator's own address; a
   * new job (that one ended with rank 3, and a coordinator tells an agent
   * that joins an ended job so) */
  stop_coord(f);
  start_coord(&f->coord, &f->auth, 4, f->addr, sizeof f->addr);
  const char *noproxy[] = {"--no-proxy", NULL};
  const char *ok[] = {"/bin/sh", "-c", "echo \"at $SHARDPLANE_COORDINATOR\"",
                      NULL};
  st = sp_test_wait_exit(start_agent(f->dir, f->addr, &f->auth, 0, noproxy, ok),
                         60);
  out = slurp(f->dir, "agent0.out");
  char want[96];
  snprintf(want, sizeof want, "[rank1]: at %s\n", f->addr);
  printf("%s", out);
  assert_int_equal(st, 0);
  assert_non_null(strstr(out, want));
  /* $SHARDPLANE_COORDINATOR_GRACE unset: the workers' default, 60 s */
  st = sp_test_wait_exit(
      start_agent(f->dir, f->addr, &f->auth, 0, noproxy, show), 60);
  free(out);
  out = slurp(f->dir, "agent0.out");
  assert_int_equal(st, 1);
  assert_non_null(strstr(out, "[rank0]: grace 60.000\n"));
  free(out);
  stop_coord(f);
}

/* A unix socket bound at path, listening or (closed) what a killed agent
 * leaves behind: its fd, or -1 once closed. */
static int socket_at(const char *path, bool listening) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  assert_true(strlen(path) < sizeof a.sun_path);
  strcpy(a.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  if (listening) {
    assert_int_equal(listen(fd, 4), 0);
    return fd;
  }
  close(fd);
  return -1;
}

/* The entries of dir named shardplane-agent-*. */
static int agent_dirs(const char *dir) {
  char cmd[256], *out;
  snprintf(cmd, sizeof cmd, "ls -A %s | grep -c '^shardplane-agent-'", dir);
  sp_test_shell(cmd, &out);
  int n = atoi(out);
  free(out);
  return n;
}

/* An agent killed by SIGKILL leaves its private directory and socket in
 * $TMPDIR; the next agent of the user removes those whose socket nobody
 * listens on, and leaves a live agent's and one not yet bound (an agent
 * starting). It removes its own on the way out. */
static void test_agent_sweeps_stale_dirs(void **state) {
  fx *f = *state;
  const char *names[] = {"shardplane-agent-stale1", "shardplane-agent-live01",
                         "shardplane-agent-fresh1"};
  char *d[3];
  for (int i = 0; i < 3; i++) {
    d[i] = sp_test_path(f->dir, names[i]);
    assert_int_equal(mkdir(d[i], 0700), 0);
  }
  char *stale_sock = sp_test_path(d[0], "coordinator.sock");
  char *live_sock = sp_test_path(d[1], "coordinator.sock");
  socket_at(stale_sock, false);
  int live = socket_at(live_sock, true);
  const char *say[] = {"/bin/sh", "-c",
                       "echo \"at $SHARDPLANE_COORDINATOR\"; exit 3", NULL};
  setenv("TMPDIR", f->dir, 1);
  setenv("NODE_RANK", "1", 1);
  pid_t pid = start_agent(f->dir, f->addr, &f->auth, -1, NULL, say);
  unsetenv("NODE_RANK");
  unsetenv("TMPDIR");
  int st = sp_test_wait_exit(pid, 60);
  char *out = slurp(f->dir, "agent9.out");
  printf("%s", out);
  assert_int_equal(st, 1);
  char want[128];
  snprintf(want, sizeof want, "at unix:%s/shardplane-agent-", f->dir);
  assert_non_null(strstr(out, want));
  struct stat sb;
  assert_int_not_equal(stat(d[0], &sb), 0);
  assert_int_equal(stat(live_sock, &sb), 0);
  assert_int_equal(stat(d[2], &sb), 0);
  assert_int_equal(agent_dirs(f->dir), 2);
  close(live);
  free(out);
  free(stale_sock);
  free(live_sock);
  for (int i = 0; i < 3; i++) free(d[i]);
  stop_coord(f);
}

/* The pid of the child of parent whose environment holds RANK=rank. */
static pid_t child_with_rank(pid_t parent, int rank) {
  char want[32];
  snprintf(want, sizeof want, "RANK=%d", rank);
  int kids[256];
  size_t n = sp_test_children(parent, kids, 256);
  for (size_t k = 0; k < n; k++) {
    char buf[65536];
    long len = sp_test_proc_file(kids[k], "environ", buf, sizeof buf);
    for (long i = 0; i < len; i += (long)strlen(buf + i) + 1)
      if (strcmp(buf + i, want) == 0) return kids[k];
  }
  return 0;
}

/* Waits until dir/name holds needle. */
static void wait_for(const char *dir, const char *name, const char *needle,
                     double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  for (;;) {
    char *out = slurp(dir, name);
    bool there = strstr(out, needle) != NULL;
    bool late = !there && sp_clock_s() > end;
    size_t len = strlen(out);
    if (late)
      printf("%s ends:\n%s\n", name, out + (len > 3000 ? len - 3000 : 0));
    free(out);
    if (there) return;
    if (late) fail_msg("no \"%s\" in %s", needle, name);
    usleep(10000);
  }
}

/* Both hosts' agents training for ever, once the job is past step 3. */
static void start_training(fx *f, pid_t a[2]) {
  const char *trainer[] = {WORKER,         "--insecure",  "--steps",
                           "100000",       "--log-every", "1",
                           "--checkpoint", "none",        NULL};
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, NULL, trainer);
  wait_for(f->dir, "agent0.out", "step 3/", 60);
}

/* The job's incarnations once incarnation 0 has ended (the coordinator
 * weighs the deaths reported within 300 ms of the first), or after 5 s;
 * the caller frees it. */
static Shardplane__V1__ListIncarnationsResponse *first_ended(fx *f) {
  Shardplane__V1__ListIncarnationsResponse *li =
      incarnations(f->addr, &f->auth);
  for (double until = sp_clock_s() + 5;
       !li->incarnations[0]->ended && sp_clock_s() < until;) {
    protobuf_c_message_free_unpacked(&li->base, NULL);
    usleep(20000);
    li = incarnations(f->addr, &f->auth);
  }
  return li;
}

/* A worker killed mid-training without restarts: its agent names its
 * rank and signal and exits 1; the other host's workers are aborted by the
 * coordinator and their agent exits 1 too. Nothing is left running. */
static void test_agent_worker_killed(void **state) {
  fx *f = *state;
  pid_t a[2];
  start_training(f, a);
  pid_t victim = child_with_rank(a[1], 3);
  assert_true(victim > 0);
  assert_int_equal(kill(victim, SIGKILL), 0);
  int st[2], max_conns;
  double t0 = sp_clock_s();
  wait_agents(a, st, f->coord.port, 60, &max_conns);
  double took = sp_clock_s() - t0;
  /* the coordinator recorded what ended the job's one incarnation */
  Shardplane__V1__ListIncarnationsResponse *li = first_ended(f);
  assert_int_equal(li->current, 0);
  assert_int_equal(li->n_incarnations, 1);
  assert_true(li->incarnations[0]->ended);
  assert_true(li->incarnations[0]->has_rank);
  assert_int_equal(li->incarnations[0]->rank, 3);
  assert_int_equal(li->incarnations[0]->signal, SIGKILL);
  printf("incarnation 0 ended: %s\n", li->incarnations[0]->reason);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  stop_coord(f);
  char *err0 = slurp(f->dir, "agent0.err"), *err1 = slurp(f->dir, "agent1.err");
  printf("agent 0:\n%s\nagent 1:\n%s\nended %.2f s after the kill\n", err0,
         err1, took);
  assert_int_equal(st[1], 1);
  assert_non_null(strstr(err1,
                         "rank 3 (local rank 1 on node 1) was killed "
                         "by signal 9"));
  assert_int_equal(st[0], 1);
  /* lost by its broken stream, not by a heartbeat timeout */
  assert_true(took < 15);
  free(err0);
  free(err1);
}

/* A node lost: one host's agent and its workers killed at once (its
 * Slurm step cancelled, the host gone). The coordinator must live through
 * it (it crashed sending the LOST alert down the dead agent's own stream,
 * whose connection was being torn down), the other host's workers are
 * aborted, and the incarnation's end names the node, not a worker death
 * no agent reported. */
static void test_agent_node_lost(void **state) {
  fx *f = *state;
  pid_t a[2];
  start_training(f, a);
  int kids[8];
  size_t n = sp_test_children(a[1], kids, 8);
  assert_int_equal(n, 2);
  assert_int_equal(kill(a[1], SIGKILL), 0);
  for (size_t i = 0; i < n; i++) kill(kids[i], SIGKILL);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 60, &max_conns);
  assert_int_equal(st[1], 128 + SIGKILL);
  assert_int_equal(st[0], 1);
  /* the coordinator is alive and answers */
  assert_int_equal(kill(f->coord.pid, 0), 0);
  Shardplane__V1__ListIncarnationsResponse *li = first_ended(f);
  assert_true(li->incarnations[0]->ended);
  printf("incarnation 0 ended: %s\n", li->incarnations[0]->reason);
  assert_non_null(strstr(li->incarnations[0]->reason, "node 1"));
  assert_non_null(strstr(li->incarnations[0]->reason, "was lost"));
  protobuf_c_message_free_unpacked(&li->base, NULL);
  int cst = sp_proc_stop(&f->coord, 5000);
  f->coord.pid = 0;
  assert_int_equal(cst, 0); /* a clean shutdown, no crash */
}

/* Replica groups that continue: a coordinator of 2 groups of 2 ranks
 * (HYBRID_SHARD, --on-group-failure continue, and the flags of more,
 * NULL-terminated, or none), and one agent per group training `steps`
 * steps with checkpoints of `kind` into ck (and the trainer's flags of
 * inject: "--inject", FAULT, or none), past step 20 when it returns. */
static void start_continuing_with(fx *f, const char *steps, const char *ck,
                                  const char *kind, const char *const *more,
                                  const char *inject, pid_t a[2]) {
  const char *flags[16] = {"--strategy",         "HYBRID_SHARD",
                           "--shard-group-size", "2",
                           "--on-group-failure", "continue"};
  for (size_t i = 0; more && more[i] && i < 8; i++) flags[6 + i] = more[i];
  start_coord_flags(&f->coord, &f->auth, 4, "127.0.0.1:0", flags, f->addr,
                    sizeof f->addr);
  const char *trainer[] = {WORKER,
                           "--insecure",
                           "--steps",
                           steps,
                           "--log-every",
                           "1",
                           "--checkpoint-dir",
                           ck,
                           "--checkpoint",
                           kind,
                           inject ? "--inject" : NULL,
                           inject,
                           NULL};
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, NULL, trainer);
  wait_for(f->dir, "agent0.out", "step 20/", 60);
}

static void start_continuing(fx *f, const char *steps, const char *ck,
                             const char *kind, pid_t a[2]) {
  start_continuing_with(f, steps, ck, kind, NULL, NULL, a);
}

/* The tensor bytes of a safetensors file (all after its header), into
 * *len; the caller frees them. */
static uint8_t *tensor_bytes(const char *dir, const char *name, size_t *len) {
  char *path = sp_test_path(dir, name);
  FILE *fp = fopen(path, "rb");
  if (fp == NULL) fail_msg("%s: cannot open", path);
  uint8_t h[8];
  assert_int_equal(fread(h, 1, 8, fp), 8);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--) hl = hl << 8 | h[i];
  assert_int_equal(fseek(fp, 0, SEEK_END), 0);
  long size = ftell(fp);
  assert_true(size > 0 && (uint64_t)size >= 8 + hl);
  *len = (size_t)size - 8 - hl;
  uint8_t *b = malloc(*len + 1);
  assert_non_null(b);
  assert_int_equal(fseek(fp, (long)(8 + hl), SEEK_SET), 0);
  assert_int_equal(fread(b, 1, *len, fp), *len);
  fclose(fp);
  free(path);
  return b;
}

/* The LOCAL checkpoints in ck of ranks 0 and 1 (replica group 0) equal
 * those of ranks 2 and 3 (group 1) byte for byte: tensors, optimizer
 * state, buffers and step. */
static void expect_replicas_equal(const char *ck) {
  char *local = sp_test_path(ck, "local");
  for (int r = 0; r < 2; r++) {
    char n0[64], n1[64];
    snprintf(n0, sizeof n0, "local-%d-of-4.safetensors", r);
    snprintf(n1, sizeof n1, "local-%d-of-4.safetensors", r + 2);
    size_t l0, l1;
    uint8_t *b0 = tensor_bytes(local, n0, &l0),
            *b1 = tensor_bytes(local, n1, &l1);
    assert_int_equal(l0, l1);
    assert_memory_equal(b0, b1, l0);
    free(b0);
    free(b1);
  }
  free(local);
}

/* The line time ("12:03:04.567 ") of an output line, in seconds of the
 * day. */
static double line_time(const char *line) {
  int h, m;
  double sec;
  if (sscanf(line, "%d:%d:%lf", &h, &m, &sec) != 3) return -1;
  return h * 3600.0 + m * 60.0 + sec;
}

/* Once the job ended: node 1's agent told of its group's drop and its
 * workers of the live state they received; the operator's record has one
 * incarnation (nothing restarted the job), replica group 1 dropped once
 * for `why` and back in the quorum, its return and cost told. */
static void expect_group1_back(fx *f, const char *why) {
  char *err1 = slurp(f->dir, "agent1.err"), *out1 = slurp(f->dir, "agent1.out");
  assert_non_null(strstr(err1, "its replica group was dropped"));
  assert_non_null(strstr(out1, "received the live state of step"));
  free(err1);
  free(out1);
  Shardplane__V1__ListIncarnationsResponse *li =
      incarnations(f->addr, &f->auth);
  assert_int_equal(li->current, 0);
  const Shardplane__V1__ReplicaQuorum *q = li->quorum;
  assert_non_null(q);
  assert_int_equal(q->groups, 2);
  assert_int_equal(q->in_quorum, 2);
  assert_int_equal(q->n_dropped, 1);
  const Shardplane__V1__ReplicaGroup *g = q->dropped[0];
  printf("%s\n", g->summary);
  assert_int_equal(g->group, 1);
  assert_int_equal(g->drops, 1);
  assert_true(g->in_quorum && g->rejoined_unix_ms >= g->dropped_unix_ms);
  assert_true(g->dropped_at_step >= 10 &&
              g->rejoined_at_step >= g->dropped_at_step);
  assert_non_null(strstr(g->why, why));
  assert_non_null(strstr(g->summary, "back "));
  protobuf_c_message_free_unpacked(&li->base, NULL);
}

/* Replica groups that continue (--on-group-failure continue): 2 groups of
 * 2 ranks (HYBRID_SHARD, one group per host), rank 3 SIGKILLed mid-
 * training. Group 1 is dropped and restarted by its agent while group 0
 * trains on: no incarnation ends, the survivors go on (a step in flight
 * is run again), group 1 rejoins with the live state, the job completes
 * with both agents ending 0, and each rank's shard, buffers and step
 * equal its replica's bit for bit (their LOCAL checkpoints). */
static void test_agent_group_continues(void **state) {
  fx *f = *state;
  char *ck = sp_test_path(f->dir, "ck");
  pid_t a[2];
  start_continuing(f, "300", ck, "local", a);
  pid_t victim = child_with_rank(a[1], 3);
  assert_true(victim > 0);
  double killed = sp_clock_s();
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  struct tm tm;
  localtime_r(&now.tv_sec, &tm);
  double killed_tod =
      tm.tm_hour * 3600.0 + tm.tm_min * 60.0 + tm.tm_sec + now.tv_nsec * 1e-9;
  assert_int_equal(kill(victim, SIGKILL), 0);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 120, &max_conns);
  double took = sp_clock_s() - killed;
  char *out0 = slurp(f->dir, "agent0.out"), *out1 = slurp(f->dir, "agent1.out");
  char *err1 = slurp(f->dir, "agent1.err");
  /* the survivors' first completed step after the kill */
  double next = -1;
  char *copy = strdup(out0), *save = NULL;
  for (char *l = strtok_r(copy, "\n", &save); l && next < 0;
       l = strtok_r(NULL, "\n", &save))
    if (strstr(l, "[rank0]: step ") && line_time(l) > killed_tod)
      next = line_time(l) - killed_tod;
  free(copy);
  printf(
      "agent 1:\n%s\n%s\nthe survivors' next step %.3f s after the kill; "
      "the job ended %.1f s after it\n",
      err1, out1, next, took);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  assert_non_null(strstr(out0, "step 300/300"));
  assert_true(next >= 0 && next < 10);
  expect_group1_back(f, "rank 3 was killed by signal 9");
  expect_replicas_equal(ck);
  free(ck);
  free(out0);
  free(out1);
  free(err1);
  stop_coord(f);
}

/* Replica groups that continue through a stall: rank 3 blocks before a
 * collective at step 30 while it keeps heartbeating (alive, no
 * progress). The stall verdict (2 s) names it, and its group is dropped
 * rather than the job aborted: the other group trains on, the stalled
 * group's agent restarts its workers, which rejoin with the live state
 * and end equal to their replicas. */
static void test_agent_group_stalls(void **state) {
  fx *f = *state;
  char *ck = sp_test_path(f->dir, "ck");
  const char *more[] = {"--stall-timeout-ms", "2000", NULL};
  pid_t a[2];
  /* steps enough for the others to be training still when the stalled
   * group is back (its agent waits 3 s on the stalled worker's SIGTERM) */
  start_continuing_with(f, "700", ck, "local", more, "stall:rank=3,step=30", a);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 120, &max_conns);
  char *out0 = slurp(f->dir, "agent0.out"), *err1 = slurp(f->dir, "agent1.err");
  printf("agent 1:\n%s\n", err1);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  assert_non_null(strstr(err1, "--inject stall: blocking"));
  assert_non_null(strstr(out0, "step 700/700"));
  /* the stall verdict's words, not the agent's kill after it */
  expect_group1_back(f, "rank 3 has not issued");
  expect_replicas_equal(ck);
  free(ck);
  free(out0);
  free(err1);
  stop_coord(f);
}

/* Replica groups that continue, a group that never comes back: node 1
 * (its agent and workers) killed mid-training. Group 0 trains to the end
 * and writes the final SHARDED checkpoint with every rank's piece (its
 * ranks write those of group 1's ranks at their shard index), the job is
 * COMPLETED, and `shardplane run` of the full world loads that
 * checkpoint. */
static void test_agent_group_never_returns(void **state) {
  fx *f = *state;
  char *ck = sp_test_path(f->dir, "ck");
  pid_t a[2];
  start_continuing(f, "150", ck, "sharded", a);
  int kids[8];
  size_t n = sp_test_children(a[1], kids, 8);
  assert_int_equal(n, 2);
  assert_int_equal(kill(a[1], SIGKILL), 0);
  for (size_t i = 0; i < n; i++) kill(kids[i], SIGKILL);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 120, &max_conns);
  assert_int_equal(st[1], 128 + SIGKILL);
  assert_int_equal(st[0], 0);
  char *out0 = slurp(f->dir, "agent0.out");
  assert_non_null(strstr(out0, "checkpoint (SHARDED) of step 150"));
  free(out0);
  Shardplane__V1__GetJobRequest jq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  Shardplane__V1__GetJobResponse *j = (Shardplane__V1__GetJobResponse *)ask(
      f->addr, &f->auth, "GetJob", &jq.base,
      &shardplane__v1__get_job_response__descriptor);
  assert_int_equal(j->state, SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED);
  assert_non_null(j->quorum);
  assert_int_equal(j->quorum->in_quorum, 1);
  assert_int_equal(j->quorum->n_dropped, 1);
  printf("%s\n", j->quorum->dropped[0]->summary);
  protobuf_c_message_free_unpacked(&j->base, NULL);
  stop_coord(f);
  char *sharded = sp_test_path(ck, "sharded");
  char *argv[] = {SHARDPLANE,
                  "run",
                  "--nproc",
                  "4",
                  "--model",
                  MLP,
                  "--strategy",
                  "HYBRID_SHARD",
                  "--shard-group-size",
                  "2",
                  "--load",
                  sharded,
                  "--steps",
                  "150",
                  "--checkpoint",
                  "none",
                  NULL};
  char *out = sp_test_path(f->dir, "load.out");
  char *err = sp_test_path(f->dir, "load.err");
  pid_t r = sp_test_spawn_logged(out, err, argv);
  int rst = sp_test_wait_exit(r, 120);
  char *lo = sp_test_read_file(out), *le = sp_test_read_file(err);
  printf("run --load:\n%s%s", lo, le);
  assert_int_equal(rst, 0);
  assert_non_null(strstr(lo, "loaded the checkpoint of step 150"));
  free(lo);
  free(le);
  free(out);
  free(err);
  free(sharded);
  free(ck);
}

/* Elastic hosts: the trainer of test_agent_restart (rank 0 slower, for
 * time to act mid-run), STEPS steps with checkpoints of `kind` every 4
 * into ck, and the agents' flags for --nnodes 1:2 with one restart. */
#define ELASTIC_STEPS "80"
#define ELASTIC_TRAINER(ck, kind)                                           \
  {                                                                         \
    WORKER, "--insecure", "--steps", ELASTIC_STEPS, "--global-batch", "24", \
        "--lr", "0.05", "--log-every", "1", "--checkpoint-dir", ck,         \
        "--checkpoint", kind, "--checkpoint-every", "4", "--inject",        \
        "slow:rank=0,factor=8", NULL                                        \
  }
#define ELASTIC_FLAGS(ck)                                              \
  {                                                                    \
    "--nnodes", "1:2", "--max-restarts", "1", "--load-on-restart", ck, \
        "--coordinator-grace", "60", NULL                              \
  }

/* The incarnation i of li ran on `world` ranks and its end's reason holds
 * `why`. */
static void expect_incarnation(
    const Shardplane__V1__ListIncarnationsResponse *li, size_t i,
    uint32_t world, const char *why) {
  assert_true(li->n_incarnations > i);
  const Shardplane__V1__Incarnation *x = li->incarnations[i];
  printf("incarnation %zu: %u ranks, %s\n", i, x->world_size, x->reason);
  assert_int_equal(x->world_size, world);
  assert_true(x->ended);
  assert_non_null(strstr(x->reason, why));
}

/* Elastic hosts (--nnodes 1:2): the job starts on the one host there;
 * a second one joining ends that incarnation without using up a restart,
 * and the next runs on both (4 ranks), resuming from the SHARDED
 * checkpoint of 2 ranks the stop's SIGTERM wrote (no step lost); the
 * second host lost (agent and workers killed) ends that one, and the last
 * runs on the first host again (2 ranks), resharded from the last
 * checkpoint of 4, to the end. */
static void test_agent_elastic_hosts(void **state) {
  fx *f = *state;
  char *ck = sp_test_path(f->dir, "ck");
  const char *flags[] = {"--join-wait-ms", "300", NULL};
  start_coord_flags(&f->coord, &f->auth, 4, "127.0.0.1:0", flags, f->addr,
                    sizeof f->addr);
  const char *trainer[] = ELASTIC_TRAINER(ck, "sharded");
  const char *extra[] = ELASTIC_FLAGS(ck);
  pid_t a =
      spawn_agent(f->dir, "host0", f->addr, &f->auth, NULL, extra, trainer);
  wait_for(f->dir, "host0.err", "node 0 of 1, ranks 0-1 of 2", 60);
  wait_for(f->dir, "host0.out", "[rank0]: step 6/", 60);
  pid_t b =
      spawn_agent(f->dir, "host1", f->addr, &f->auth, NULL, extra, trainer);
  wait_for(f->dir, "host1.err", "node 1 of 2, ranks 2-3 of 4", 60);
  wait_for(f->dir, "host0.err", "incarnation 1 loads ", 60);
  /* on 4 ranks for a while: checkpoints written by that world */
  wait_for(f->dir, "host0.out", "[rank0]: step 30/", 60);
  int kids[8];
  size_t n = sp_test_children(b, kids, 8);
  assert_int_equal(kill(b, SIGKILL), 0);
  for (size_t i = 0; i < n; i++) kill(kids[i], SIGKILL);
  assert_int_equal(sp_test_wait_exit(a, 120), 0);
  assert_int_equal(sp_test_wait_exit(b, 10), 128 + SIGKILL);
  Shardplane__V1__ListIncarnationsResponse *li =
      incarnations(f->addr, &f->auth);
  /* a clean shutdown: no crash, and no leak under the sanitizers */
  int cst = sp_proc_stop(&f->coord, 5000);
  f->coord.pid = 0;
  assert_int_equal(cst, 0);
  char *out = slurp(f->dir, "host0.out"), *err = slurp(f->dir, "host0.err");
  printf("host 0:\n%s\n", err);
  assert_int_equal(li->n_incarnations, 3);
  expect_incarnation(li, 0, 2, "a host joined");
  expect_incarnation(li, 1, 4, "node 1 (ranks 2-3 on ");
  expect_incarnation(li, 2, 2,
                     "completed: all 2 ranks finished at step " ELASTIC_STEPS);
  /* the join used up no restart; the loss its one */
  assert_int_equal(li->restarts, 1);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  /* each incarnation after the first resumed from a SHARDED checkpoint */
  const char *r1 = strstr(out, "[rank0]: resuming after step ");
  assert_non_null(r1);
  assert_non_null(strstr(r1 + 1, "[rank0]: resuming after step "));
  assert_non_null(strstr(err, "incarnation 1 loads "));
  assert_non_null(strstr(strstr(err, "incarnation 1 loads "), "(SHARDED, "));
  assert_non_null(strstr(strstr(err, "incarnation 2 loads "), "(SHARDED, "));
  /* the join lost no step: incarnation 0 checkpointed the last step it
   * ran, and incarnation 1 went on after it */
  unsigned long joined =
      strtoul(r1 + strlen("[rank0]: resuming after step "), NULL, 10);
  char ran[64], next[64];
  snprintf(ran, sizeof ran, "checkpoint (SHARDED) of step %lu:", joined);
  snprintf(next, sizeof next, "[rank0]: step %lu/", joined + 1);
  const char *saved = strstr(out, ran), *after = strstr(out, next);
  printf("the join: incarnation 0 saved step %lu and stopped\n", joined);
  assert_true(saved != NULL && saved < r1);
  assert_true(after != NULL && after > r1);
  assert_non_null(
      strstr(out, "[rank0]: step " ELASTIC_STEPS "/" ELASTIC_STEPS));
  free(out);
  free(err);
  free(ck);
}

/* A host that never comes back after the coordinator's restart no longer
 * holds up the next restart: once the reattach grace has passed, the
 * incarnation the death of the other host's peers ended gives way to one
 * on the host that is back (elastic, the world read back from the state
 * dir), which trains to the end. Before, the restart waited for every
 * node of the world for ever. */
static void test_agent_elastic_after_coordinator_restart(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state"), *ck = sp_test_path(f->dir, "ck");
  const char *flags[] = {
      "--state-dir", sd,  "--join-wait-ms", "300", "--reattach-grace-ms",
      "2000",        NULL};
  start_coord_flags(&f->coord, &f->auth, 4, "127.0.0.1:0", flags, f->addr,
                    sizeof f->addr);
  const char *trainer[] = ELASTIC_TRAINER(ck, "full");
  const char *extra[] = ELASTIC_FLAGS(ck);
  pid_t h[2];
  for (int i = 0; i < 2; i++) {
    char stem[16];
    snprintf(stem, sizeof stem, "host%d", i);
    h[i] = spawn_agent(f->dir, stem, f->addr, &f->auth, NULL, extra, trainer);
  }
  /* the coordinator numbers the hosts as they come: node 0 survives */
  int first = -1;
  for (double end = sp_clock_s() + 60; first < 0 && sp_clock_s() < end;
       usleep(10000))
    for (int i = 0; i < 2 && first < 0; i++) {
      char name[16];
      snprintf(name, sizeof name, "host%d.err", i);
      char *e = slurp(f->dir, name);
      if (strstr(e, "ranks 0-1 of 4")) first = i;
      free(e);
    }
  assert_true(first >= 0);
  pid_t a = h[first], b = h[1 - first];
  char out0[16], err0[16];
  snprintf(out0, sizeof out0, "host%d.out", first);
  snprintf(err0, sizeof err0, "host%d.err", first);
  wait_for(f->dir, out0, "checkpoint (FULL) of step 8:", 60);
  kill9_coord(f);
  int kids[8];
  size_t n = sp_test_children(b, kids, 8);
  assert_int_equal(kill(b, SIGKILL), 0);
  for (size_t i = 0; i < n; i++) kill(kids[i], SIGKILL);
  char listen[64];
  snprintf(listen, sizeof listen, "%s", f->addr);
  start_coord_flags(&f->coord, &f->auth, 4, listen, flags, f->addr,
                    sizeof f->addr);
  double t_back = sp_clock_s();
  wait_for(f->dir, err0, "incarnation 1 loads ", 60);
  double waited = sp_clock_s() - t_back;
  assert_int_equal(sp_test_wait_exit(a, 120), 0);
  assert_int_equal(sp_test_wait_exit(b, 10), 128 + SIGKILL);
  Shardplane__V1__ListIncarnationsResponse *li =
      incarnations(f->addr, &f->auth);
  /* a clean shutdown: no crash, and no leak under the sanitizers */
  int cst = sp_proc_stop(&f->coord, 5000);
  f->coord.pid = 0;
  assert_int_equal(cst, 0);
  char *err = slurp(f->dir, err0);
  printf(
      "host 0:\n%s\nincarnation 1 began %.1f s after the coordinator "
      "came back (reattach grace 2 s)\n",
      err, waited);
  assert_int_equal(li->n_incarnations, 2);
  assert_int_equal(li->incarnations[0]->world_size, 4);
  expect_incarnation(li, 1, 2,
                     "completed: all 2 ranks finished at step " ELASTIC_STEPS);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  assert_true(waited >= 1.5);
  free(err);
  free(ck);
  free(sd);
}

/* A worker killed mid-training with --max-restarts 1: the coordinator
 * ends incarnation 0 naming the rank and signal, every agent stops its
 * workers and starts them again, they load the last checkpoint and the
 * job finishes with the parameters of an undisturbed run (a resumed run
 * continues bit-exactly). The store of incarnation 0 is gone in
 * incarnation 1. */
static void test_agent_restart(void **state) {
  fx *f = *state;
  char *ck = sp_test_path(f->dir, "ck");
  /* rank 0 a straggler (4x its step), for time to kill mid-run; the
   * numbers do not change */
  const char *trainer[] = {WORKER,
                           "--insecure",
                           "--steps",
                           "24",
                           "--global-batch",
                           "24",
                           "--lr",
                           "0.05",
                           "--log-every",
                           "1",
                           "--checkpoint-dir",
                           ck,
                           "--checkpoint-every",
                           "4",
                           "--inject",
                           "slow:rank=0,factor=4",
                           NULL};
  const char *restarts[] = {"--max-restarts", "1", "--load-on-restart", ck,
                            NULL};
  pid_t a[2];
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, restarts, trainer);
  wait_for(f->dir, "agent0.out", "checkpoint (FULL) of step 8:", 60);
  store_set(f->addr, &f->auth, "comm/test-incarnation-0", "kept?");
  assert_true(store_has(f->addr, &f->auth, "comm/test-incarnation-0"));
  pid_t victim = child_with_rank(a[1], 3);
  assert_true(victim > 0);
  assert_int_equal(kill(victim, SIGKILL), 0);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 120, &max_conns);
  Shardplane__V1__ListIncarnationsResponse *li =
      incarnations(f->addr, &f->auth);
  bool leaked = store_has(f->addr, &f->auth, "comm/test-incarnation-0");
  stop_coord(f);
  char *out0 = slurp(f->dir, "agent0.out"), *err0 = slurp(f->dir, "agent0.err"),
       *err1 = slurp(f->dir, "agent1.err");
  printf("agent 0:\n%s\nagent 1:\n%s\n", err0, err1);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  assert_non_null(strstr(err1,
                         "rank 3 (local rank 1 on node 1) was killed "
                         "by signal 9"));
  assert_non_null(strstr(err0,
                         "incarnation 0 ended (rank 3 was killed by "
                         "signal 9 (Killed))"));
  assert_non_null(strstr(err0, "incarnation 1 loads "));
  const char *resumed = strstr(out0, "resuming after step ");
  assert_non_null(resumed);
  printf("%.60s\n", resumed);
  assert_non_null(strstr(out0, "[rank0]: step 24/24"));
  /* the record: incarnation 0 ended by rank 3's SIGKILL, 1 by the job's
   * completion */
  expect_restarted_after_rank3(li);
  assert_true(li->incarnations[1]->ended);
  assert_true(li->incarnations[1]->completed);
  assert_false(li->incarnations[1]->has_rank);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  /* incarnation 1 could not read incarnation 0's key */
  assert_false(leaked);

  assert_int_equal(sp_test_wait_exit(start_reference(f->dir, "24"), 120), 0);
  same_as_reference(f->dir, ck);
  free(out0);
  free(err0);
  free(err1);
  free(ck);
}

/* An agent whose workers have not failed when the stop comes (a slow
 * host's, still training when the coordinator heard of the death) waits
 * for the next incarnation rather than taking its workers' end for the
 * job's: it once exited there, and the other hosts' workers of the next
 * incarnation waited for its ranks until their rendezvous timed out. The
 * trainer is a script: in incarnation 0 rank 3 fails and the others would
 * run on, rank 2 deaf to SIGTERM (so node 1 takes 3 s to stop, and node 0
 * has long stopped when the next incarnation begins); in incarnation 1
 * every rank ends at once. */
static void test_agent_waits_after_stop(void **state) {
  fx *f = *state;
  const char *trainer[] = {
      "/bin/sh", "-c",
      "if [ \"$SHARDPLANE_INCARNATION\" != 0 ]; then exit 0; fi; "
      "if [ \"$RANK\" = 3 ]; then sleep 0.3; exit 3; fi; "
      "if [ \"$RANK\" = 2 ]; then trap '' TERM; fi; exec sleep 30",
      NULL};
  const char *restarts[] = {"--max-restarts", "1", NULL};
  pid_t a[2];
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, restarts, trainer);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 60, &max_conns);
  char *err0 = slurp(f->dir, "agent0.err"), *err1 = slurp(f->dir, "agent1.err");
  printf("agent 0:\n%s\nagent 1:\n%s\n", err0, err1);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  assert_non_null(strstr(err0,
                         "incarnation 0 ended (rank 3 exited with "
                         "status 3)"));
  assert_non_null(strstr(err0, "incarnation 1: starting the workers again"));
  assert_non_null(strstr(err1, "incarnation 1: starting the workers again"));
  free(err0);
  free(err1);
}

/* A restart loads only a checkpoint the job wrote: one an earlier job
 * left in the --load-on-restart directory is not passed to the trainer
 * (the agent once passed it, and a job that died before its first save
 * resumed from another job's last step), and the agent says the
 * incarnation starts afresh. The trainer is a script: in incarnation 0
 * rank 3 fails; in incarnation 1 every rank prints its arguments. */
static void test_agent_restart_skips_old_checkpoint(void **state) {
  fx *f = *state;
  char *ck = sp_test_path(f->dir, "ck"), *full = sp_test_path(ck, "full");
  char *model = sp_test_path(full, "model.safetensors");
  assert_int_equal(mkdir(ck, 0777), 0);
  assert_int_equal(mkdir(full, 0777), 0);
  FILE *fp = fopen(model, "w");
  assert_non_null(fp);
  fputs("an earlier job's", fp);
  fclose(fp);
  const char *trainer[] = {
      "/bin/sh", "-c",
      "if [ \"$SHARDPLANE_INCARNATION\" != 0 ]; then echo \"args [$*]\"; "
      "exit 0; fi; if [ \"$RANK\" = 3 ]; then sleep 0.3; exit 3; fi; "
      "exec sleep 30",
      "trainer", NULL};
  const char *restarts[] = {"--max-restarts", "1", "--load-on-restart", ck,
                            NULL};
  pid_t a[2];
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, restarts, trainer);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 60, &max_conns);
  char *out0 = slurp(f->dir, "agent0.out"), *err0 = slurp(f->dir, "agent0.err");
  printf("agent 0:\n%s%s\n", out0, err0);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  assert_non_null(strstr(err0,
                         "incarnation 1 starts afresh from step 0: no "
                         "checkpoint written in "));
  assert_non_null(strstr(out0, "[rank0]: args []"));
  assert_null(strstr(out0, "--load"));
  free(out0);
  free(err0);
  free(model);
  free(full);
  free(ck);
}

/* The coordinator SIGKILLed mid-training and started again on its port
 * and state dir: each agent registers again as the same node and
 * incarnation while its workers train on (their Session streams
 * reattached through the proxy, whose one connection comes back), and
 * supervision works after it: a worker killed then restarts the job
 * (--max-restarts 1), which ends with the parameters of an undisturbed
 * run. The agents once kept their broken stream: the death after the
 * outage ended the job (exit 1) instead of restarting it. */
static void test_agents_ride_out_coordinator_restart(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state"), *ck = sp_test_path(f->dir, "ck");
  start_coord_at(&f->coord, &f->auth, 4, "127.0.0.1:0", sd, f->addr,
                 sizeof f->addr);
  /* rank 0 a straggler, as in test_agent_restart: time for the outage and
   * the kill before the end */
  const char *trainer[] = {WORKER,
                           "--insecure",
                           "--steps",
                           "24",
                           "--global-batch",
                           "24",
                           "--lr",
                           "0.05",
                           "--log-every",
                           "1",
                           "--checkpoint-dir",
                           ck,
                           "--checkpoint-every",
                           "4",
                           "--inject",
                           "slow:rank=0,factor=4",
                           NULL};
  const char *restarts[] = {"--max-restarts", "1", "--load-on-restart", ck,
                            NULL};
  pid_t a[2];
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, restarts, trainer);
  wait_for(f->dir, "agent0.out", "[rank0]: step 2/", 60);
  kill9_coord(f);
  double t_kill = sp_clock_s();
  sp_test_sleep_ms(500);
  char listen[64];
  snprintf(listen, sizeof listen, "%s", f->addr);
  start_coord_at(&f->coord, &f->auth, 4, listen, sd, f->addr, sizeof f->addr);
  /* a checkpoint written after the restart: the kill below lands in
   * training, whether or not the agents are back yet (a death while the
   * coordinator is away waits for it) */
  wait_for(f->dir, "agent0.out", "checkpoint (FULL) of step 12:", 60);
  pid_t victim = child_with_rank(a[1], 3);
  assert_true(victim > 0);
  assert_int_equal(kill(victim, SIGKILL), 0);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 120, &max_conns);
  double took = sp_clock_s() - t_kill;
  Shardplane__V1__ListIncarnationsResponse *li =
      incarnations(f->addr, &f->auth);
  stop_coord(f);
  char *out0 = slurp(f->dir, "agent0.out"), *err0 = slurp(f->dir, "agent0.err"),
       *err1 = slurp(f->dir, "agent1.err");
  printf(
      "agent 0:\n%s\nagent 1:\n%s\nconnections to the coordinator after "
      "its restart: at most %d; %.1f s from the coordinator's kill to the "
      "job's end\n",
      err0, err1, max_conns, took);
  assert_int_equal(st[0], 0);
  assert_int_equal(st[1], 0);
  for (int i = 0; i < 2; i++) {
    const char *e = i ? err1 : err0;
    assert_non_null(strstr(e, "lost the coordinator at "));
    assert_non_null(strstr(e, "registered again"));
    assert_non_null(strstr(e, "rode out 1 outage of the coordinator"));
  }
  /* the death after the outage restarted the job, as one before it */
  assert_non_null(strstr(err0,
                         "incarnation 0 ended (rank 3 was killed by "
                         "signal 9 (Killed))"));
  assert_non_null(strstr(out0, "[rank0]: step 24/24"));
  expect_restarted_after_rank3(li);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  /* each agent came back on one connection: no second one beside it */
  assert_int_equal(max_conns, 2);

  assert_int_equal(sp_test_wait_exit(start_reference(f->dir, "24"), 120), 0);
  same_as_reference(f->dir, ck);
  free(out0);
  free(err0);
  free(err1);
  free(ck);
  free(sd);
}

/* A coordinator that never comes back: past --coordinator-grace the agent
 * stops its workers and exits 4, naming the coordinator's address and the
 * flag, and blames no rank (its workers, given the same grace, could not
 * reach it either). */
static void test_agent_gives_up_after_grace(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state");
  start_coord_at(&f->coord, &f->auth, 2, "127.0.0.1:0", sd, f->addr,
                 sizeof f->addr);
  const char *trainer[] = {WORKER,         "--insecure",  "--steps",
                           "100000",       "--log-every", "1",
                           "--checkpoint", "none",        NULL};
  const char *grace[] = {"--coordinator-grace", "1", NULL};
  pid_t a = start_agent(f->dir, f->addr, &f->auth, 0, grace, trainer);
  wait_for(f->dir, "agent0.out", "[rank0]: step 3/", 60);
  kill9_coord(f);
  double t0 = sp_clock_s();
  int st = sp_test_wait_exit(a, 30);
  double took = sp_clock_s() - t0;
  char *err = slurp(f->dir, "agent0.err");
  printf("%s\nexit %d, %.2f s after the coordinator's kill (grace 1 s)\n", err,
         st, took);
  assert_int_equal(st, 4);
  char want[256];
  snprintf(want, sizeof want,
           "the coordinator at %s was unreachable for "
           "longer than the grace period of 1 s (--coordinator-grace)",
           f->addr);
  assert_non_null(strstr(err, want));
  assert_null(strstr(err, "; stopping the workers"));
  assert_null(strstr(err, "decides on a restart"));
  /* the grace, the workers' own end (they had the same grace) and the
   * agent's stop of any left: SIGTERM, SIGKILL 3 s later */
  assert_true(took < 1 + 5);
  free(err);
  free(sd);
}

/* The coordinator's side of supervision, spoken to directly: a death
 * with a restart left stops every agent, the next incarnation begins only
 * once every agent stopped, and it cannot read the last one's store; a
 * death without restarts left ends the job naming the rank and signal;
 * agents that disagree on --max-restarts, or report a rank not theirs,
 * are refused; the records outlive a coordinator restart on its state
 * dir. */
static void test_incarnations_protocol(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state");
  char addr[64], why[512];
  start_coord_at(&f->coord, &f->auth, 4, "127.0.0.1:0", sd, addr, sizeof addr);
  sp_rpc_sync *c0 = client(addr, &f->auth, SP_ROLE_WORKER),
              *c1 = client(addr, &f->auth, SP_ROLE_WORKER),
              *c2 = client(addr, &f->auth, SP_ROLE_WORKER);
  sp_rpc_sync_stream *g0 = agent_open(c0, 0, 2, 1);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  sp_rpc_sync_stream *g1 = agent_open(c1, 1, 2, 1);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  /* another --max-restarts than the job's first agent: refused */
  sp_rpc_sync_stream *bad = agent_open(c2, 1, 2, 5);
  ProtobufCMessage *m = NULL;
  sp_rpc_status status;
  assert_int_equal(
      sp_rpc_sync_stream_recv(bad, &shardplane__v1__agent_down__descriptor,
                              10000, &m, &status),
      SP_ENOENT);
  printf("a third agent: %s\n", status.message);
  assert_int_equal(status.code, SP_RPC_FAILED_PRECONDITION);
  assert_non_null(strstr(status.message, "--max-restarts 5"));
  sp_rpc_sync_stream_close(bad);

  store_set(addr, &f->auth, "comm/incarnation-0", "x");
  /* rank 3 of node 1 killed: both agents are told to stop */
  agent_send(g1, 0, 3, 0, SIGKILL);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, why, sizeof why);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, NULL, 0);
  printf("stop: %s\n", why);
  assert_string_equal(why, "rank 3 was killed by signal 9 (Killed)");
  /* until every agent stopped, incarnation 0 is the current one */
  agent_send(g0, 0, -1, 0, 0);
  sp_test_sleep_ms(100);
  Shardplane__V1__ListIncarnationsResponse *li = incarnations(addr, &f->auth);
  assert_int_equal(li->current, 0);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  assert_true(store_has(addr, &f->auth, "comm/incarnation-0"));
  agent_send(g1, 0, -1, 0, 0);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 1, NULL, 0);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 1, NULL, 0);
  /* incarnation 1 cannot read incarnation 0's keys */
  assert_false(store_has(addr, &f->auth, "comm/incarnation-0"));
  store_set(addr, &f->auth, "comm/incarnation-1", "y");
  assert_true(store_has(addr, &f->auth, "comm/incarnation-1"));

  /* a death reported for an incarnation that ended is not this one's */
  agent_send(g0, 0, 1, 1, 0);
  /* rank 0 exits 1 in incarnation 1: no restart left, the job ends */
  agent_send(g0, 1, 0, 1, 0);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_END, 1, why, sizeof why);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_END, 1, NULL, 0);
  printf("end: %s\n", why);
  assert_string_equal(why,
                      "rank 0 exited with status 1; no restarts left "
                      "(--max-restarts 1)");
  /* a rank that is not the agent's node's: refused */
  agent_send(g1, 1, 0, 1, 0);
  assert_int_equal(
      sp_rpc_sync_stream_recv(g1, &shardplane__v1__agent_down__descriptor,
                              10000, &m, &status),
      SP_ENOENT);
  assert_int_equal(status.code, SP_RPC_INVALID_ARGUMENT);
  printf("node 1 reporting rank 0: %s\n", status.message);
  sp_rpc_sync_stream_close(g0);
  sp_rpc_sync_stream_close(g1);
  sp_rpc_sync_close(c0);
  sp_rpc_sync_close(c1);
  sp_rpc_sync_close(c2);

  /* the records, read back by a coordinator started again on the f->dir */
  stop_coord(f);
  char listen[64];
  snprintf(listen, sizeof listen, "%s", addr);
  start_coord_at(&f->coord, &f->auth, 4, listen, sd, addr, sizeof addr);
  li = incarnations(addr, &f->auth);
  expect_restarted_after_rank3(li);
  assert_true(li->incarnations[1]->ended);
  assert_int_equal(li->incarnations[1]->rank, 0);
  assert_int_equal(li->incarnations[1]->exit_code, 1);
  assert_true(li->incarnations[1]->started_unix_ms >=
              li->incarnations[0]->ended_unix_ms);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  stop_coord(f);
  free(sd);
}

/* Agents registering again, spoken to directly: one whose stream broke
 * while the coordinator lived takes its old stream's place (another
 * process for the node is still refused); a coordinator SIGKILLed between
 * a death and the next incarnation, restarted on its state dir, goes on
 * with the restart (it once took the ended incarnation for the job's end)
 * and begins the next incarnation only once every node is back and
 * stopped; an agent ahead of the coordinator's record is refused, naming
 * the state dir. */
static void test_incarnations_rejoin(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state");
  char addr[64], why[512];
  start_coord_at(&f->coord, &f->auth, 4, "127.0.0.1:0", sd, addr, sizeof addr);
  sp_rpc_sync *c[4];
  for (int i = 0; i < 4; i++) c[i] = client(addr, &f->auth, SP_ROLE_WORKER);
  sp_rpc_sync_stream *g0 = agent_open(c[0], 0, 2, 1);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  sp_rpc_sync_stream *g1 = agent_open(c[1], 1, 2, 1);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  /* node 0's agent again, on a new stream: it replaces the old one */
  sp_rpc_sync_stream *g0b = agent_open_as(c[2], 0, 2, 1, 0, false, 0);
  expect_cmd(g0b, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  expect_end(g0, SP_RPC_UNAVAILABLE, why, sizeof why);
  printf("the old stream: %s\n", why);
  sp_rpc_sync_stream_close(g0);
  /* another process for node 0: refused */
  sp_rpc_sync_stream *other = agent_open_as(c[3], 0, 2, 1, 0, false, 7);
  expect_end(other, SP_RPC_ALREADY_EXISTS, why, sizeof why);
  sp_rpc_sync_stream_close(other);

  /* rank 3 dies; node 0 stops, then the coordinator is killed */
  agent_send(g1, 0, 3, 0, SIGKILL);
  expect_cmd(g0b, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, NULL, 0);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, NULL, 0);
  agent_send(g0b, 0, -1, 0, 0);
  sp_test_sleep_ms(100);
  kill9_coord(f);
  sp_rpc_sync_stream_close(g0b);
  sp_rpc_sync_stream_close(g1);
  for (int i = 0; i < 4; i++) sp_rpc_sync_close(c[i]);
  char listen[64];
  snprintf(listen, sizeof listen, "%s", addr);
  start_coord_at(&f->coord, &f->auth, 4, listen, sd, addr, sizeof addr);
  for (int i = 0; i < 3; i++) c[i] = client(addr, &f->auth, SP_ROLE_WORKER);
  /* node 0 back, stopped: told to stop (the restart goes on), and the
   * next incarnation waits for node 1 */
  g0 = agent_open_as(c[0], 0, 2, 1, 0, true, 0);
  ProtobufCMessage *m = NULL;
  sp_rpc_status status;
  assert_int_equal(
      sp_rpc_sync_stream_recv(g0, &shardplane__v1__agent_down__descriptor,
                              10000, &m, &status),
      0);
  Shardplane__V1__AgentDown *d = (Shardplane__V1__AgentDown *)m;
  printf(
      "node 0 after the restart: command %d, incarnation %llu (%s), "
      "durable %d\n",
      d->command, (unsigned long long)d->incarnation, d->reason, d->durable);
  assert_int_equal(d->command, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP);
  assert_int_equal(d->incarnation, 0);
  assert_true(d->durable);
  protobuf_c_message_free_unpacked(m, NULL);
  agent_send(g0, 0, -1, 0, 0);
  sp_test_sleep_ms(100);
  Shardplane__V1__ListIncarnationsResponse *li = incarnations(addr, &f->auth);
  assert_int_equal(li->current, 0);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  /* node 1 back, its workers not yet stopped: it stops them, and then
   * incarnation 1 begins for both */
  g1 = agent_open_as(c[1], 1, 2, 1, 0, false, 0);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, NULL, 0);
  agent_send(g1, 0, -1, 0, 0);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 1, NULL, 0);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 1, NULL, 0);
  /* an agent that runs an incarnation the record does not have */
  other = agent_open_as(c[2], 1, 2, 1, 5, false, 0);
  expect_end(other, SP_RPC_FAILED_PRECONDITION, why, sizeof why);
  printf("an agent at incarnation 5: %s\n", why);
  assert_non_null(strstr(why, "--state-dir"));
  sp_rpc_sync_stream_close(other);
  sp_rpc_sync_stream_close(g0);
  sp_rpc_sync_stream_close(g1);
  for (int i = 0; i < 3; i++) sp_rpc_sync_close(c[i]);
  stop_coord(f);
  free(sd);
}

/* A node whose agent never registers again after the coordinator's
 * restart holds up the next restart only for --reattach-grace-ms: node 0
 * is back and stopped, node 1 never comes, and incarnation 1 begins once
 * the grace has passed (it waited for ever before). */
static void test_incarnations_rejoin_deadline(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state");
  char addr[64], listen[64];
  const char *flags[] = {"--state-dir", sd, "--reattach-grace-ms", "1000",
                         NULL};
  start_coord_flags(&f->coord, &f->auth, 4, "127.0.0.1:0", flags, addr,
                    sizeof addr);
  sp_rpc_sync *c[2];
  for (int i = 0; i < 2; i++) c[i] = client(addr, &f->auth, SP_ROLE_WORKER);
  sp_rpc_sync_stream *g0 = agent_open(c[0], 0, 2, 1);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  sp_rpc_sync_stream *g1 = agent_open(c[1], 1, 2, 1);
  expect_cmd(g1, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 0, NULL, 0);
  agent_send(g1, 0, 3, 0, SIGKILL);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, NULL, 0);
  agent_send(g0, 0, -1, 0, 0);
  sp_test_sleep_ms(100);
  kill9_coord(f);
  sp_rpc_sync_stream_close(g0);
  sp_rpc_sync_stream_close(g1);
  for (int i = 0; i < 2; i++) sp_rpc_sync_close(c[i]);
  snprintf(listen, sizeof listen, "%s", addr);
  start_coord_flags(&f->coord, &f->auth, 4, listen, flags, addr, sizeof addr);
  double t_back = sp_clock_s();
  c[0] = client(addr, &f->auth, SP_ROLE_WORKER);
  g0 = agent_open_as(c[0], 0, 2, 1, 0, true, 0);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP, 0, NULL, 0);
  agent_send(g0, 0, -1, 0, 0);
  expect_cmd(g0, SHARDPLANE__V1__AGENT_COMMAND__AGENT_START, 1, NULL, 0);
  double waited = sp_clock_s() - t_back;
  printf(
      "incarnation 1 began %.2f s after the coordinator's restart, node 1 "
      "never back (--reattach-grace-ms 1000)\n",
      waited);
  assert_true(waited >= 0.9);
  Shardplane__V1__ListIncarnationsResponse *li = incarnations(addr, &f->auth);
  assert_int_equal(li->current, 1);
  protobuf_c_message_free_unpacked(&li->base, NULL);
  sp_rpc_sync_stream_close(g0);
  sp_rpc_sync_close(c[0]);
  stop_coord(f);
  free(sd);
}

/* The record of a job that completed: incarnation 0 ended by the
 * completion, kept so across the coordinator's restart; a late agent is
 * told the job completed and exits 0 at once, starting no worker and
 * changing no record. */
static void expect_completed(const char *addr, const sp_tauth *auth) {
  Shardplane__V1__ListIncarnationsResponse *li = incarnations(addr, auth);
  assert_int_equal(li->current, 0);
  assert_int_equal(li->n_incarnations, 1);
  const Shardplane__V1__Incarnation *x = li->incarnations[0];
  printf("incarnation 0: ended %d completed %d: %s\n", x->ended, x->completed,
         x->reason);
  assert_true(x->ended);
  assert_true(x->completed);
  assert_false(x->has_rank);
  assert_non_null(strstr(x->reason,
                         "completed: all 2 ranks finished at "
                         "step 3"));
  protobuf_c_message_free_unpacked(&li->base, NULL);
  /* and the verdict agrees */
  Shardplane__V1__GetVerdictRequest q =
      SHARDPLANE__V1__GET_VERDICT_REQUEST__INIT;
  Shardplane__V1__Verdict *v = (Shardplane__V1__Verdict *)ask(
      addr, auth, "GetVerdict", &q.base, &shardplane__v1__verdict__descriptor);
  printf("verdict: %s\n", v->headline);
  assert_int_equal(v->state, SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED);
  protobuf_c_message_free_unpacked(&v->base, NULL);
}

static void test_agent_on_completed_job(void **state) {
  fx *f = *state;
  char *sd = sp_test_path(f->dir, "state");
  start_coord_at(&f->coord, &f->auth, 2, "127.0.0.1:0", sd, f->addr,
                 sizeof f->addr);
  const char *trainer[] = {WORKER,         "--insecure", "--steps", "3",
                           "--checkpoint", "none",       NULL};
  pid_t a = start_agent(f->dir, f->addr, &f->auth, 0, NULL, trainer);
  assert_int_equal(sp_test_wait_exit(a, 60), 0);
  expect_completed(f->addr, &f->auth);
  /* the record survives the coordinator's restart as it was */
  stop_coord(f);
  start_coord_at(&f->coord, &f->auth, 2, "127.0.0.1:0", sd, f->addr,
                 sizeof f->addr);
  expect_completed(f->addr, &f->auth);
  double t0 = sp_clock_s();
  const char *restarts[] = {"--max-restarts", "2", NULL};
  a = start_agent(f->dir, f->addr, &f->auth, 0, restarts, trainer);
  int st = sp_test_wait_exit(a, 30);
  double took = sp_clock_s() - t0;
  char *err = slurp(f->dir, "agent0.err"), *out = slurp(f->dir, "agent0.out");
  printf("late agent: exit %d after %.2f s:\n%s", st, took, err);
  assert_int_equal(st, 0);
  assert_true(took < 10);
  assert_non_null(strstr(err,
                         "the job already completed: all 2 ranks "
                         "finished at step 3; nothing to start"));
  assert_null(strstr(err, "[rank"));
  assert_null(strstr(out, "[rank"));
  assert_null(strstr(err, "incarnation 1"));
  expect_completed(f->addr, &f->auth);
  free(err);
  free(out);
  free(sd);
}

/* A stall on one host is printed by every host's agent the moment the
 * coordinator opens the alert, naming the rank, beside its own workers'
 * lines: the operator of host 0 learns that rank 3, on host 1, stalls. */
static void test_agents_print_alerts(void **state) {
  fx *f = *state;
  char *argv[] = {SP_BIN_DIR "/shardplane-coordinator",
                  "--listen",
                  "127.0.0.1:0",
                  "--model",
                  MLP,
                  "--world-size",
                  "4",
                  "--insecure",
                  "--token-file",
                  f->auth.token_file,
                  "--quiet",
                  "--stall-timeout-ms",
                  "2000",
                  NULL};
  sp_diag d = {{0}};
  if (sp_proc_spawn(&f->coord, argv, false, true, "listening on 127.0.0.1:%d",
                    &d))
    fail_msg("coordinator: %s", d.msg);
  snprintf(f->addr, sizeof f->addr, "127.0.0.1:%d", f->coord.port);
  const char *trainer[] = {WORKER,     "--insecure",          "--steps",
                           "100000",   "--checkpoint",        "none",
                           "--inject", "stall:rank=3,step=3", NULL};
  const char *grace[] = {"--stop-grace", "1", NULL};
  pid_t a[2];
  for (int i = 0; i < 2; i++)
    a[i] = start_agent(f->dir, f->addr, &f->auth, i, grace, trainer);
  for (int i = 0; i < 2; i++)
    wait_for(f->dir, i ? "agent1.err" : "agent0.err",
             "[alert]: STALL: rank 3 has not issued", 60);
  for (int i = 0; i < 2; i++) kill(a[i], SIGTERM);
  int st[2], max_conns;
  wait_agents(a, st, f->coord.port, 30, &max_conns);
  char *err0 = slurp(f->dir, "agent0.err");
  printf("agent 0:\n%s\n", err0);
  assert_non_null(strstr(err0, "(culprit rank 3; victims 0-2)"));
  assert_int_equal(st[0], 128 + SIGTERM);
  assert_int_equal(st[1], 128 + SIGTERM);
  free(err0);
}

/* SIGTERM to an agent whose workers wait in the rendezvous for a host
 * that never comes: they reach no step boundary, so within the default
 * --stop-grace (10 s, not the rendezvous' own timeout) the agent stops
 * them, names them and exits 143. */
static void test_agent_stop_in_rendezvous(void **state) {
  fx *f = *state;
  const char *trainer[] = {WORKER,         "--insecure", "--steps", "100000",
                           "--checkpoint", "none",       NULL};
  pid_t a = start_agent(f->dir, f->addr, &f->auth, 0, NULL, trainer);
  pid_t w[2] = {0};
  for (double end = sp_clock_s() + 30; (w[0] <= 0 || w[1] <= 0);) {
    if (sp_clock_s() > end) fail_msg("the agent started no workers");
    w[0] = child_with_rank(a, 0);
    w[1] = child_with_rank(a, 1);
    usleep(20000);
  }
  sp_test_sleep_ms(1000); /* in the rendezvous by now */
  double t0 = sp_clock_s();
  assert_int_equal(kill(a, SIGTERM), 0);
  int st = sp_test_wait_exit(a, 40);
  double took = sp_clock_s() - t0;
  char *err = slurp(f->dir, "agent0.err");
  printf("%s\nexit %d, %.2f s after SIGTERM\n", err, st, took);
  assert_int_equal(st, 128 + SIGTERM);
  assert_true(took < 10 + 3);
  assert_non_null(strstr(err,
                         "ranks 0, 1 have not reached a step boundary "
                         "within the 10 s of --stop-grace"));
  for (int r = 0; r < 2; r++) assert_false(kill(w[r], 0) == 0);
  free(err);
}

/* Bad usage is named by its flag, and exits 2. */
static void test_agent_bad_usage(void **state) {
  fx *f = *state;
  char *out = sp_test_path(f->dir, "out"), *err = sp_test_path(f->dir, "err");
  struct {
    const char *args[12];
    int code;
    const char *says;
  } cases[] = {
      {{"--coordinator", f->addr, "--insecure", "--", "/bin/true", NULL},
       2,
       "--nproc-per-node is required"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "2", NULL},
       2,
       "no trainer"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "0", "--",
        "/bin/true", NULL},
       2,
       "--nproc-per-node"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "3", "--",
        "/bin/true", NULL},
       2,
       "world size 4 is not a multiple"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "2",
        "--nnodes", "3", "--", "/bin/true", NULL},
       2,
       "--nnodes 3 x --nproc-per-node 2 is 6 ranks; the job has 4"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "2", "--",
        "/bin/true", NULL},
       2,
       "--node-rank is required with 2 hosts"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "2",
        "--node-rank", "2", "--", "/bin/true", NULL},
       2,
       "--node-rank 2: the job has 2 hosts (0 to 1)"},
      {{"--coordinator", f->addr, "--insecure", "--nproc-per-node", "2",
        "--coordinator-grace", "0", "--", "/bin/true", NULL},
       2,
       "--coordinator-grace \"0\""},
      {{"--help", NULL}, 0, NULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *argv[16] = {SHARDPLANE, "agent"};
    size_t k = 2;
    for (size_t j = 0; cases[i].args[j]; j++)
      argv[k++] = (char *)cases[i].args[j];
    argv[k] = NULL;
    setenv(SP_TOKEN_ENV, f->auth.token[SP_ROLE_WORKER], 1);
    int st = sp_test_wait_exit(sp_test_spawn_logged(out, err, argv), 30);
    unsetenv(SP_TOKEN_ENV);
    char *e = sp_test_read_file(err), *o = sp_test_read_file(out);
    printf("case %zu: exit %d: %s", i, st, e);
    assert_int_equal(st, cases[i].code);
    if (cases[i].says)
      assert_non_null(strstr(e, cases[i].says));
    else
      assert_non_null(strstr(o, "usage: shardplane agent"));
    free(e);
    free(o);
  }
  stop_coord(f);
  free(out);
  free(err);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_agent_env_and_exit_codes, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_sweeps_stale_dirs, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_bad_usage, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_incarnations_protocol, fx_setup_bare,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_incarnations_rejoin, fx_setup_bare,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_incarnations_rejoin_deadline,
                                      fx_setup_bare, fx_teardown),
      cmocka_unit_test_setup_teardown(test_agents_train_as_run, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agents_two_namespaces, fx_setup_bare,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_worker_killed, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_group_continues, fx_setup_bare,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_group_stalls, fx_setup_bare,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_group_never_returns,
                                      fx_setup_bare, fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_elastic_hosts, fx_setup_bare,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(
          test_agent_elastic_after_coordinator_restart, fx_setup_bare,
          fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_node_lost, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_restart, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_waits_after_stop, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_restart_skips_old_checkpoint,
                                      fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_agents_ride_out_coordinator_restart,
                                      fx_setup_bare, fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_gives_up_after_grace,
                                      fx_setup_bare, fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_stop_in_rendezvous, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_agent_on_completed_job,
                                      fx_setup_bare, fx_teardown),
      cmocka_unit_test_setup_teardown(test_agents_print_alerts, fx_setup_bare,
                                      fx_teardown),
  };
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
