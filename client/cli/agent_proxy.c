/* The agent's proxy (agent_proxy.h). */
#include "agent_proxy.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/strmap.h"
#include "base/thread_name.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* "/shardplane.v1.Coordinator/" and the longest method name fit */
#define PATH_CAP 96

struct sp_agent_proxy {
  uv_loop_t loop;
  uv_async_t stop;
  pthread_t thread;
  bool started;
  sp_rpc_server *srv;
  sp_rpc_client *up;
  sp_rpc_method *methods;
  char (*paths)[PATH_CAP];
  size_t n_methods;
  char *bearer; /* "Bearer <token>" or NULL */
  char dir[80]; /* private, 0700; sun_path holds 107 bytes */
  char socket_path[108];
  char address[116]; /* "unix:" socket_path */
  bool stopping;
  /* written by the proxy thread, read after the join */
  sp_agent_proxy_stats stats;
};

/* One proxied call: the worker's side (down) and the coordinator's (up).
 * It is freed once both have ended. */
typedef struct pcall {
  sp_agent_proxy *p;
  sp_rpc_call *down; /* NULL once finished or cancelled */
  sp_rpc_ccall *up;  /* NULL once closed */
  /* inside a call that may close the upstream call at once (its on_close
   * then must not free what the caller still uses) */
  bool up_started, up_closed, busy;
} pcall;

static void pcall_maybe_free(pcall *pc) {
  if (pc->down == NULL && (pc->up_closed || !pc->up_started) && !pc->busy)
    free(pc);
}

static void up_on_message(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                          void *user) {
  pcall *pc = user;
  if (pc->down == NULL) return;
  int rc = sp_rpc_call_send_raw(pc->down, data, len);
  if (rc == 0) return;
  /* the worker does not read its answers: it loses the call, not the
   * agent its memory (8 MiB queued per call, the engine's limit) */
  sp_rpc_call_finishf(pc->down, SP_RPC_RESOURCE_EXHAUSTED,
                      "agent: cannot pass a message on: %s", sp_strerror(rc));
  pc->down = NULL;
  sp_rpc_ccall_cancel(call);
}

static void up_on_close(sp_rpc_ccall *call, const sp_rpc_status *st,
                        void *user) {
  (void)call;
  pcall *pc = user;
  pc->up = NULL;
  pc->up_closed = true;
  if (pc->down != NULL) {
    sp_rpc_call_finish(pc->down, st->code, st->message);
    pc->down = NULL;
  }
  pcall_maybe_free(pc);
}

/* Starts the upstream call on the first thing the worker sends. */
static int up_start(pcall *pc, sp_rpc_call *down) {
  sp_agent_proxy *p = pc->p;
  size_t alen = 0;
  const uint8_t *auth = sp_rpc_call_metadata(down, "authorization", &alen);
  sp_rpc_md md = {"authorization", auth, alen};
  if (auth == NULL && p->bearer != NULL) {
    md.value = (const uint8_t *)p->bearer;
    md.len = strlen(p->bearer);
  }
  int64_t left = sp_rpc_call_remaining_ms(down);
  uint64_t timeout = left < 0 ? 0 : left == 0 ? 1 : (uint64_t)left;
  static const sp_rpc_ccall_cbs cbs = {up_on_message, up_on_close};
  pc->busy = true;
  pc->up_started = true;
  int rc = sp_rpc_client_start(p->up, sp_rpc_call_path(down), &md,
                               md.value ? 1 : 0, timeout, &cbs, pc, &pc->up);
  pc->busy = false;
  if (rc != 0) {
    pc->up_started = false;
    pc->up = NULL;
  }
  p->stats.calls++;
  return rc;
}

static pcall *pcall_of(sp_rpc_call *down) {
  pcall *pc = sp_rpc_call_user(down);
  if (pc != NULL) return pc;
  pc = calloc(1, sizeof *pc);
  if (pc == NULL) return NULL;
  pc->p = sp_rpc_call_method_user(down);
  pc->down = down;
  sp_rpc_call_set_user(down, pc);
  if (up_start(pc, down) != 0) {
    sp_rpc_call_set_user(down, NULL);
    free(pc);
    return NULL;
  }
  return pc;
}

static void down_on_message(sp_rpc_call *down, const ProtobufCMessage *msg,
                            const uint8_t *raw, size_t len) {
  (void)msg;
  pcall *pc = pcall_of(down);
  if (pc == NULL) {
    sp_rpc_call_finish(down, SP_RPC_UNAVAILABLE,
                       "agent: cannot start the call to the coordinator");
    return;
  }
  if (pc->down == NULL) { /* the upstream call ended as it started */
    pcall_maybe_free(pc);
    return;
  }
  if (pc->up == NULL) return;
  int rc = sp_rpc_ccall_send(pc->up, raw, len);
  if (rc != 0 && pc->down != NULL) {
    sp_rpc_call_finishf(pc->down, SP_RPC_RESOURCE_EXHAUSTED,
                        "agent: cannot pass a message on: %s", sp_strerror(rc));
    pc->down = NULL;
    sp_rpc_ccall_cancel(pc->up);
  }
}

static void down_on_half_close(sp_rpc_call *down) {
  pcall *pc = pcall_of(down);
  if (pc == NULL) {
    sp_rpc_call_finish(down, SP_RPC_UNAVAILABLE,
                       "agent: cannot start the call to the coordinator");
    return;
  }
  if (pc->down == NULL) {
    pcall_maybe_free(pc);
    return;
  }
  if (pc->up != NULL) sp_rpc_ccall_close_send(pc->up);
}

static void down_on_cancel(sp_rpc_call *down, int code) {
  (void)code;
  pcall *pc = sp_rpc_call_user(down);
  if (pc == NULL) return;
  pc->down = NULL;
  pc->busy = true;
  if (pc->up != NULL) sp_rpc_ccall_cancel(pc->up); /* on_close follows */
  pc->busy = false;
  pcall_maybe_free(pc);
}

static void on_server_down(sp_rpc_server *srv, void *arg) {
  (void)srv;
  sp_agent_proxy *p = arg;
  uv_close((uv_handle_t *)&p->stop, NULL);
}

static void on_stop(uv_async_t *a) {
  sp_agent_proxy *p = a->data;
  if (p->stopping) return;
  p->stopping = true;
  /* calls still open are the workers' of a job that ends: 200 ms for
   * their last answers, then they are cancelled */
  sp_rpc_server_shutdown(p->srv, 200, on_server_down, p);
  sp_rpc_client_close(p->up, NULL, NULL);
  p->up = NULL;
}

static void *proxy_main(void *arg) {
  sp_agent_proxy *p = arg;
  sp_thread_name("agent-proxy");
  uv_run(&p->loop, UV_RUN_DEFAULT);
  return NULL;
}

void sp_agent_proxy_free(sp_agent_proxy *p) {
  if (p == NULL) return;
  if (p->started) sp_agent_proxy_stop(p);
  free(p->methods);
  free(p->paths);
  free(p->bearer);
  free(p);
}

static int build_methods(sp_agent_proxy *p) {
  const ProtobufCServiceDescriptor *sd =
      &shardplane__v1__coordinator__descriptor;
  p->n_methods = sd->n_methods;
  p->methods = calloc(sd->n_methods, sizeof *p->methods);
  p->paths = calloc(sd->n_methods, sizeof *p->paths);
  if (p->methods == NULL || p->paths == NULL) return SP_ENOMEM;
  for (unsigned i = 0; i < sd->n_methods; i++) {
    int n = snprintf(p->paths[i], PATH_CAP, "/%s/%s", sd->name,
                     sd->methods[i].name);
    if (n <= 0 || n >= PATH_CAP) return SP_ETOOBIG;
    /* every kind as a stream of raw messages: the proxy passes on what
     * comes, the coordinator judges it */
    p->methods[i] = (sp_rpc_method){.path = p->paths[i],
                                    .kind = SP_RPC_BIDI_STREAMING,
                                    .input = NULL,
                                    .on_message = down_on_message,
                                    .on_half_close = down_on_half_close,
                                    .on_cancel = down_on_cancel,
                                    .user = p};
  }
  return 0;
}

#define DIR_STEM "shardplane-agent-"
#define SOCKET_NAME "coordinator.sock"

/* Whether path is a unix socket that refuses a connection: nobody
 * listens on it any more. A full backlog answers EAGAIN (the socket does
 * not block), which is a live one. */
static bool refused(const char *path) {
  struct stat st;
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  if (lstat(path, &st) != 0 || !S_ISSOCK(st.st_mode) ||
      strlen(path) >= sizeof a.sun_path)
    return false;
  memcpy(a.sun_path, path, strlen(path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool r = connect(fd, (struct sockaddr *)&a, sizeof a) != 0 &&
           errno == ECONNREFUSED;
  close(fd);
  return r;
}

/* The directories in tmp of this user's agents that ended without
 * removing theirs (SIGKILL, a crash): each holds a socket nobody listens
 * on. One whose socket takes connections, or has none yet (an agent
 * starting), is left; rmdir removes only an empty one. */
static void sweep_stale(const char *tmp) {
  DIR *dir = opendir(tmp);
  if (dir == NULL) return;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    if (strncmp(e->d_name, DIR_STEM, strlen(DIR_STEM)) != 0) continue;
    char path[128], sock[160];
    int n = snprintf(path, sizeof path, "%s/%s", tmp, e->d_name);
    if (n <= 0 || (size_t)n >= sizeof path) continue;
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid())
      continue;
    snprintf(sock, sizeof sock, "%s/" SOCKET_NAME, path);
    if (!refused(sock)) continue;
    unlink(sock);
    rmdir(path);
  }
  closedir(dir);
}

/* The private directory and the socket's path in it; stale ones of
 * agents killed before they could remove theirs go first. */
static int make_dir(sp_agent_proxy *p, sp_diag *d) {
  const char *tmp = getenv("TMPDIR");
  /* a long $TMPDIR would not leave room for the socket's name */
  if (tmp == NULL || tmp[0] == '\0' || strlen(tmp) > 50) tmp = "/tmp";
  sweep_stale(tmp);
  snprintf(p->dir, sizeof p->dir, "%s/" DIR_STEM "XXXXXX", tmp);
  if (mkdtemp(p->dir) == NULL) { /* mode 0700 */
    int e = errno;
    p->dir[0] = '\0';
    return sp_diag_set(d, SP_EIO, "cannot create a directory in %s: %s", tmp,
                       strerror(e));
  }
  snprintf(p->socket_path, sizeof p->socket_path, "%s/" SOCKET_NAME, p->dir);
  snprintf(p->address, sizeof p->address, SP_RPC_UNIX_PREFIX "%s",
           p->socket_path);
  return 0;
}

const char *sp_agent_proxy_address(const sp_agent_proxy *p) {
  return p->address;
}

/* The socket file and the directory, once nothing listens. */
static void remove_dir(sp_agent_proxy *p) {
  if (p->dir[0] == '\0') return;
  unlink(p->socket_path);
  rmdir(p->dir);
  p->dir[0] = '\0';
}

int sp_agent_proxy_start(const char *upstream, const sp_rpc_client_opts *opts,
                         sp_agent_proxy **out, sp_diag *d) {
  sp_agent_proxy *p = calloc(1, sizeof *p);
  if (p == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  int rc = make_dir(p, d);
  if (rc != 0) {
    free(p);
    return rc;
  }
  rc = build_methods(p);
  if (rc == 0 && opts != NULL && opts->token != NULL) {
    size_t n = strlen(opts->token);
    p->bearer = malloc(n + 8);
    if (p->bearer == NULL)
      rc = SP_ENOMEM;
    else
      snprintf(p->bearer, n + 8, "Bearer %s", opts->token);
  }
  if (rc != 0) {
    remove_dir(p);
    sp_agent_proxy_free(p);
    return sp_diag_set(d, rc, "cannot set up the proxy: %s", sp_strerror(rc));
  }
  if ((rc = uv_loop_init(&p->loop)) != 0) {
    remove_dir(p);
    sp_agent_proxy_free(p);
    return sp_diag_set(d, SP_EIO, "uv_loop_init: %s", uv_strerror(rc));
  }
  /* the workers' connections live as long as the job: never idle-closed */
  sp_rpc_server_opts so = {.idle_timeout_ms = UINT64_MAX};
  sp_rpc_client_opts co = opts ? *opts : (sp_rpc_client_opts){0};
  co.token = NULL; /* each call carries its caller's, or the agent's */
  rc = sp_rpc_server_new(&p->loop, &so, &p->srv);
  if (rc == 0) rc = sp_rpc_server_add_methods(p->srv, p->methods, p->n_methods);
  if (rc == 0) rc = sp_rpc_server_listen(p->srv, p->address, NULL, d);
  if (rc == 0) {
    rc = sp_rpc_client_open(&p->loop, upstream, &co, &p->up);
    if (rc != 0)
      sp_diag_set(d, rc, "cannot open a client for %s: %s", upstream,
                  sp_strerror(rc));
  }
  if (rc == 0) {
    rc = uv_async_init(&p->loop, &p->stop, on_stop);
    p->stop.data = p;
    if (rc == 0 && pthread_create(&p->thread, NULL, proxy_main, p) != 0) {
      uv_close((uv_handle_t *)&p->stop, NULL);
      rc = SP_EIO;
    }
    if (rc != 0) sp_diag_set(d, SP_EIO, "cannot start the proxy's thread");
  }
  if (rc != 0) {
    /* nothing ran yet: close what was opened and let the loop release it */
    if (p->up) sp_rpc_client_close(p->up, NULL, NULL);
    if (p->srv) sp_rpc_server_shutdown(p->srv, 0, NULL, NULL);
    uv_run(&p->loop, UV_RUN_DEFAULT);
    if (p->srv) sp_rpc_server_free(p->srv);
    uv_loop_close(&p->loop);
    remove_dir(p);
    sp_agent_proxy_free(p);
    return rc < 0 ? rc : SP_EIO;
  }
  p->started = true;
  *out = p;
  return 0;
}

void sp_agent_proxy_stop(sp_agent_proxy *p) {
  if (p == NULL || !p->started) return;
  p->started = false;
  uv_async_send(&p->stop);
  pthread_join(p->thread, NULL);
  /* the shutdown callback ran; the server is still to free */
  sp_rpc_server_stats st;
  sp_rpc_server_get_stats(p->srv, &st);
  p->stats.local_conns = st.connections_total;
  sp_rpc_server_free(p->srv);
  p->srv = NULL;
  uv_run(&p->loop, UV_RUN_NOWAIT);
  uv_loop_close(&p->loop);
  remove_dir(p);
}

void sp_agent_proxy_stats_get(const sp_agent_proxy *p,
                              sp_agent_proxy_stats *s) {
  *s = p->stats;
}
