/* Unary RPC latency and throughput of our gRPC engine, against two
 * baselines measured in the same run on the same machine:
 *
 * - the floor: a raw TCP ping-pong (blocking sockets, TCP_NODELAY, a message
 *   of the same size as the Echo request) between two threads of this
 *   process. No RPC stack can beat it; the latency goal is a ratio to it.
 * - a gRPC C++ server (async API, one completion-queue thread per CPU)
 *   serving the same tests/proto/echo.proto, started as a child process.
 *
 * Both RPC servers are driven by the same client, our engine's async client
 * (sp_rpc_client_*), so the comparison is server against server: one
 * HTTP/2 connection, N calls of Echo.Unary kept in flight from one client
 * loop (each completion starts the next call). Our server runs on its own
 * loop in a thread of this process. Latency is measured with one caller
 * (one outstanding call); throughput with 1, 8 and 64 callers.
 *
 * Every figure is measured --runs times, interleaving the contenders within
 * each run so they see the same machine state, and the median is shown.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "echo.pb-c.h"
#include "echo_service.h"
#include "rpc.h"

extern char **environ;

#define ECHO_UNARY "/shardplane.testing.Echo/Unary"
#define N_CALLERS 3
static const int k_callers[N_CALLERS] = {1, 8, 64};
/* the goals of the issue that asked for this benchmark */
#define GOAL_P50_VS_FLOOR 2.5
#define GOAL_TPUT_VS_GRPCPP 3.0

typedef struct bench_opts {
  double seconds; /* per figure, after warm-up */
  int runs;
  size_t payload;
  const char *grpcpp_server; /* NULL: skip the comparison */
  const char *grpcpp_skip;   /* why it is skipped */
  int grpcpp_threads;        /* 0: its default (one per CPU) */
} bench_opts;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t warmup_ns(const bench_opts *o) {
  double w = o->seconds / 4;
  if (w > 0.25) w = 0.25;
  return (uint64_t)(w * 1e9);
}

/* ------------------------------------------------------------------ */
/* Samples and statistics                                              */
/* ------------------------------------------------------------------ */

typedef struct samples {
  uint64_t *v;
  size_t n, cap;
} samples;

static int samples_add(samples *s, uint64_t x) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 1u << 16;
    uint64_t *v = realloc(s->v, cap * sizeof *v);
    if (v == NULL) return SP_ENOMEM;
    s->v = v;
    s->cap = cap;
  }
  s->v[s->n++] = x;
  return 0;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Nearest-rank percentile in microseconds; sorts s. */
static double percentile_us(samples *s, double p) {
  if (s->n == 0) return 0;
  qsort(s->v, s->n, sizeof *s->v, cmp_u64);
  size_t i = (size_t)(p * (double)(s->n - 1) + 0.5);
  return (double)s->v[i] / 1e3;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(const double *v, int n) {
  double t[64];
  if (n <= 0) return 0;
  if (n > 64) n = 64;
  memcpy(t, v, (size_t)n * sizeof *t);
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

/* One contender's figures for one run. */
typedef struct result {
  double p50_us, p99_us; /* 1 caller */
  double tput[N_CALLERS]; /* calls/s */
  /* CPU time per call, client + server, us: immune to the wall-clock noise
   * of a shared machine. 0 when unknown. */
  double cpu_us[N_CALLERS];
  bool ok;
} result;

/* CPU time of this process (our client, and our server thread). */
static uint64_t cpu_self_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* CPU time of a child process from /proc (clock-tick resolution);
 * UINT64_MAX when unavailable. */
static uint64_t cpu_child_ns(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return UINT64_MAX;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the name may hold spaces */
  unsigned long long ut = 0, st = 0;
  if (p == NULL || sscanf(p + 2,
                          "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu "
                          "%llu",
                          &ut, &st) != 2)
    return UINT64_MAX;
  long hz = sysconf(_SC_CLK_TCK);
  return hz > 0 ? (ut + st) * (1000000000ull / (unsigned long long)hz)
                : UINT64_MAX;
}

/* ------------------------------------------------------------------ */
/* Raw TCP ping-pong: the floor                                        */
/* ------------------------------------------------------------------ */

static int read_full(int fd, void *buf, size_t n) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static int write_full(int fd, const void *buf, size_t n) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t r = write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

typedef struct tcp_floor {
  int lfd, port;
  size_t msg;
  pthread_t th;
} tcp_floor;

static void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Echoes fixed-size messages back on every accepted connection, one
 * connection at a time, until the listener is shut down. */
static void *tcp_echo_thread(void *arg) {
  tcp_floor *t = arg;
  uint8_t *buf = malloc(t->msg);
  for (;;) {
    int fd = accept(t->lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      break;
    }
    set_nodelay(fd);
    while (buf != NULL && read_full(fd, buf, t->msg) == 0 &&
           write_full(fd, buf, t->msg) == 0) {
    }
    close(fd);
  }
  free(buf);
  return NULL;
}

static int loopback_listener(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 8) != 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(sa.sin_port);
  return fd;
}

static int tcp_floor_start(tcp_floor *t, size_t msg) {
  t->msg = msg;
  t->lfd = loopback_listener(&t->port);
  if (t->lfd < 0) return SP_EIO;
  if (pthread_create(&t->th, NULL, tcp_echo_thread, t) != 0) {
    close(t->lfd);
    return SP_EIO;
  }
  return 0;
}

static void tcp_floor_stop(tcp_floor *t) {
  shutdown(t->lfd, SHUT_RDWR); /* wakes accept() */
  pthread_join(t->th, NULL);
  close(t->lfd);
}

/* Round trips of msg bytes for o->seconds after a warm-up. */
static int tcp_floor_measure(const tcp_floor *t, const bench_opts *o,
                             result *r) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)t->port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (fd >= 0) close(fd);
    return SP_EIO;
  }
  set_nodelay(fd);
  uint8_t *buf = calloc(1, t->msg);
  samples s = {0};
  int rc = buf ? 0 : SP_ENOMEM;
  uint64_t t0 = now_ns(), t_measure = t0 + warmup_ns(o),
           t_end = t_measure + (uint64_t)(o->seconds * 1e9), done = 0;
  while (rc == 0) {
    uint64_t a = now_ns();
    if (a >= t_end) break;
    if (write_full(fd, buf, t->msg) != 0 || read_full(fd, buf, t->msg) != 0) {
      rc = SP_EIO;
      break;
    }
    uint64_t b = now_ns();
    if (a >= t_measure) {
      rc = samples_add(&s, b - a);
      done++;
    }
  }
  close(fd);
  free(buf);
  if (rc == 0) {
    r->p50_us = percentile_us(&s, 0.50);
    r->p99_us = percentile_us(&s, 0.99);
    r->tput[0] = (double)done / o->seconds;
    r->ok = true;
  }
  free(s.v);
  return rc;
}

/* ------------------------------------------------------------------ */
/* Our engine's Echo server, on its own loop in a thread               */
/* ------------------------------------------------------------------ */

typedef struct our_server {
  uv_loop_t loop;
  uv_async_t stop;
  sp_rpc_server *srv;
  int port;
  pthread_t th;
} our_server;

static void *our_server_thread(void *arg) {
  our_server *s = arg;
  uv_run(&s->loop, UV_RUN_DEFAULT);
  return NULL;
}

static void our_server_down(sp_rpc_server *srv, void *arg) {
  (void)srv;
  our_server *s = arg;
  uv_close((uv_handle_t *)&s->stop, NULL);
}

static void our_server_on_stop(uv_async_t *a) {
  our_server *s = a->data;
  sp_rpc_server_shutdown(s->srv, 0, our_server_down, s);
}

/* Sets the server up here, then hands its loop to a thread. */
static int our_server_start(our_server *s, sp_diag *d) {
  if (uv_loop_init(&s->loop) != 0)
    return sp_diag_set(d, SP_EIO, "uv_loop_init failed");
  int rc = sp_rpc_server_new(&s->loop, NULL, &s->srv);
  if (rc == 0) rc = sp_echo_register(s->srv);
  if (rc == 0) rc = sp_rpc_server_listen(s->srv, "127.0.0.1:0", &s->port, d);
  if (rc != 0) return rc;
  uv_async_init(&s->loop, &s->stop, our_server_on_stop);
  s->stop.data = s;
  if (pthread_create(&s->th, NULL, our_server_thread, s) != 0)
    return sp_diag_set(d, SP_EIO, "cannot start the server thread");
  return 0;
}

static void our_server_stop(our_server *s) {
  uv_async_send(&s->stop);
  pthread_join(s->th, NULL);
  sp_rpc_server_free(s->srv);
  uv_loop_close(&s->loop);
}

/* ------------------------------------------------------------------ */
/* The gRPC C++ server, a child process                                */
/* ------------------------------------------------------------------ */

typedef struct grpcpp_server {
  pid_t pid;
  int to_child; /* its stdin: closing it stops the server */
  int port;
} grpcpp_server;

static int grpcpp_start(grpcpp_server *g, const bench_opts *o, sp_diag *d) {
  int in[2], out[2];
  if (pipe(in) != 0) return sp_diag_set(d, SP_EIO, "pipe: %s", strerror(errno));
  if (pipe(out) != 0) {
    close(in[0]);
    close(in[1]);
    return sp_diag_set(d, SP_EIO, "pipe: %s", strerror(errno));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, in[1]);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  char threads[16];
  snprintf(threads, sizeof threads, "%d", o->grpcpp_threads);
  char *argv[] = {(char *)o->grpcpp_server, "--threads", threads, NULL};
  if (o->grpcpp_threads <= 0) argv[1] = NULL;
  int rc = posix_spawn(&g->pid, o->grpcpp_server, &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  g->to_child = in[1];
  if (rc != 0) {
    close(in[1]);
    close(out[0]);
    return sp_diag_set(d, SP_EIO, "cannot start %s: %s", o->grpcpp_server,
                       strerror(rc));
  }
  /* "PORT <n>\n", within 20 s */
  char line[64];
  size_t have = 0;
  g->port = 0;
  while (have < sizeof line - 1) {
    struct pollfd p = {.fd = out[0], .events = POLLIN};
    if (poll(&p, 1, 20000) <= 0) break;
    ssize_t n = read(out[0], line + have, sizeof line - 1 - have);
    if (n <= 0) break;
    have += (size_t)n;
    line[have] = '\0';
    if (strchr(line, '\n') != NULL) {
      sscanf(line, "PORT %d", &g->port);
      break;
    }
  }
  close(out[0]);
  if (g->port <= 0) {
    close(g->to_child);
    kill(g->pid, SIGKILL);
    waitpid(g->pid, NULL, 0);
    return sp_diag_set(d, SP_EIO, "%s did not report its port",
                       o->grpcpp_server);
  }
  return 0;
}

static void grpcpp_stop(grpcpp_server *g) {
  close(g->to_child);
  kill(g->pid, SIGTERM);
  for (int i = 0; i < 300; i++) { /* up to 3 s, then kill */
    if (waitpid(g->pid, NULL, WNOHANG) == g->pid) return;
    usleep(10 * 1000);
  }
  kill(g->pid, SIGKILL);
  waitpid(g->pid, NULL, 0);
}

/* ------------------------------------------------------------------ */
/* The client driver: N unary calls kept in flight on one connection   */
/* ------------------------------------------------------------------ */

typedef struct driver driver;

typedef struct slot {
  driver *d;
  sp_rpc_ccall *call; /* in flight, or NULL */
  uint64_t t0;
  bool replied;
} slot;

struct driver {
  uv_loop_t *loop;
  sp_rpc_client *cl;
  const uint8_t *req; /* packed request; the reply has the same bytes */
  size_t req_len;
  uint64_t t_measure, t_end;
  int active;
  uint64_t done, errors;
  uint64_t total;  /* completed calls, warm-up and drain included */
  pid_t server_pid; /* the server's process when it is not this one */
  samples *lat; /* 1 caller: every call's latency */
  char error[SP_RPC_STATUS_MESSAGE_MAX + 64];
  uv_timer_t watchdog;
};

static void drv_failed(driver *d, const char *what) {
  d->errors++;
  if (d->error[0] == '\0') snprintf(d->error, sizeof d->error, "%s", what);
}

static const sp_rpc_ccall_cbs k_cbs;

static void slot_start(slot *s) {
  driver *d = s->d;
  s->replied = false;
  s->t0 = now_ns();
  s->call = NULL;
  int rc = sp_rpc_client_start(d->cl, ECHO_UNARY, NULL, 0, 0, &k_cbs, s,
                               &s->call);
  if (rc == 0 && s->call == NULL) return; /* it failed at once: on_close ran */
  if (rc == 0) rc = sp_rpc_ccall_send(s->call, d->req, d->req_len);
  if (rc == 0) rc = sp_rpc_ccall_close_send(s->call);
  if (rc != 0) {
    /* start failures never reach on_close; send failures do */
    if (s->call == NULL) {
      drv_failed(d, sp_strerror(rc));
      if (--d->active == 0) uv_stop(d->loop);
    } else {
      sp_rpc_ccall_cancel(s->call);
    }
  }
}

static void on_reply(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                     void *user) {
  (void)call;
  slot *s = user;
  driver *d = s->d;
  if (len == d->req_len && memcmp(data, d->req, len) == 0) s->replied = true;
}

static void on_done(sp_rpc_ccall *call, const sp_rpc_status *st, void *user) {
  (void)call;
  slot *s = user;
  driver *d = s->d;
  uint64_t t = now_ns();
  s->call = NULL;
  if (st->code != SP_RPC_OK || !s->replied) {
    char m[sizeof d->error];
    snprintf(m, sizeof m, "%s: %s", sp_rpc_code_name(st->code),
             st->code == SP_RPC_OK ? "wrong or missing reply" : st->message);
    drv_failed(d, m);
    if (--d->active == 0) uv_stop(d->loop);
    return; /* a failing slot stops: no busy loop of errors */
  }
  d->total++;
  if (t >= d->t_measure && t < d->t_end) {
    d->done++;
    if (d->lat != NULL && samples_add(d->lat, t - s->t0) != 0)
      drv_failed(d, "out of memory");
  }
  if (t < d->t_end) {
    slot_start(s);
    return;
  }
  if (--d->active == 0) uv_stop(d->loop);
}

static const sp_rpc_ccall_cbs k_cbs = {.on_message = on_reply,
                                       .on_close = on_done};

static void on_watchdog(uv_timer_t *t) {
  driver *d = t->data;
  drv_failed(d, "calls still open 10 s after the end; cancelled");
  uv_stop(d->loop);
}

/* Keeps `callers` calls in flight for the warm-up plus o->seconds. */
static int drive(driver *d, slot *slots, int callers, const bench_opts *o,
                 double *tput, double *cpu_us) {
  uint64_t c0 = cpu_self_ns(), s0 = d->server_pid ? cpu_child_ns(d->server_pid) : 0;
  uint64_t t0 = now_ns();
  d->t_measure = t0 + warmup_ns(o);
  d->t_end = d->t_measure + (uint64_t)(o->seconds * 1e9);
  d->done = 0;
  d->total = 0;
  d->errors = 0;
  d->error[0] = '\0';
  d->active = callers;
  for (int i = 0; i < callers; i++) {
    slots[i] = (slot){.d = d};
  }
  for (int i = 0; i < callers && d->errors == 0; i++) slot_start(&slots[i]);
  uv_timer_start(&d->watchdog, on_watchdog,
                 (d->t_end - t0) / 1000000u + 10000u, 0);
  if (d->active > 0) uv_run(d->loop, UV_RUN_DEFAULT);
  uv_timer_stop(&d->watchdog);
  if (d->active > 0) { /* the watchdog fired: cancel what is left */
    for (int i = 0; i < callers; i++)
      if (slots[i].call != NULL) sp_rpc_ccall_cancel(slots[i].call);
    while (d->active > 0 && uv_run(d->loop, UV_RUN_ONCE) != 0) {
    }
  }
  *tput = (double)d->done / o->seconds;
  uint64_t cpu = cpu_self_ns() - c0;
  if (d->server_pid) {
    uint64_t s1 = cpu_child_ns(d->server_pid);
    cpu = s0 != UINT64_MAX && s1 != UINT64_MAX ? cpu + (s1 - s0) : 0;
  }
  *cpu_us = d->total && cpu ? (double)cpu / 1e3 / (double)d->total : 0;
  return d->errors ? SP_EIO : 0;
}

static int cl_measure(driver *d, const bench_opts *o, result *r,
                      const char *who) {
  slot slots[64];
  samples lat = {0};
  d->lat = &lat;
  int rc = drive(d, slots, 1, o, &r->tput[0], &r->cpu_us[0]);
  d->lat = NULL;
  if (rc == 0) {
    r->p50_us = percentile_us(&lat, 0.50);
    r->p99_us = percentile_us(&lat, 0.99);
  }
  free(lat.v);
  for (int i = 1; i < N_CALLERS && rc == 0; i++)
    rc = drive(d, slots, k_callers[i], o, &r->tput[i], &r->cpu_us[i]);
  if (rc != 0) {
    fprintf(stderr, "rpc: %s: %llu failed calls; first: %s\n", who,
            (unsigned long long)d->errors, d->error);
    return rc;
  }
  r->ok = true;
  return 0;
}

static void client_closed(void *arg) { *(bool *)arg = true; }

static int driver_open(driver *d, uv_loop_t *loop, int port,
                       const uint8_t *req, size_t len) {
  memset(d, 0, sizeof *d);
  d->loop = loop;
  d->req = req;
  d->req_len = len;
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  sp_rpc_client_opts co = {.connect_timeout_ms = 5000};
  int rc = sp_rpc_client_new(loop, addr, &co, &d->cl);
  if (rc != 0) return rc;
  uv_timer_init(loop, &d->watchdog);
  d->watchdog.data = d;
  return 0;
}

static void driver_close(driver *d) {
  bool closed = false;
  sp_rpc_client_close(d->cl, client_closed, &closed);
  uv_close((uv_handle_t *)&d->watchdog, NULL);
  while (!closed && uv_run(d->loop, UV_RUN_ONCE) != 0) {
  }
  uv_run(d->loop, UV_RUN_NOWAIT);
}

/* ------------------------------------------------------------------ */
/* Output                                                              */
/* ------------------------------------------------------------------ */

enum { FLOOR, OURS, GRPCPP, N_CONTENDERS };
static const char *const k_names[N_CONTENDERS] = {
    "raw TCP ping-pong (floor)", "ours (sp_rpc server)", "gRPC C++ server"};

static result med(const result *runs, int n) {
  result m = {0};
  double v[64];
  int k = 0;
  for (int i = 0; i < n; i++)
    if (runs[i].ok) v[k++] = runs[i].p50_us;
  if (k == 0) return m;
  m.ok = true;
  m.p50_us = median(v, k);
  k = 0;
  for (int i = 0; i < n; i++)
    if (runs[i].ok) v[k++] = runs[i].p99_us;
  m.p99_us = median(v, k);
  for (int c = 0; c < N_CALLERS; c++) {
    k = 0;
    for (int i = 0; i < n; i++)
      if (runs[i].ok) v[k++] = runs[i].tput[c];
    m.tput[c] = median(v, k);
    k = 0;
    for (int i = 0; i < n; i++)
      if (runs[i].ok) v[k++] = runs[i].cpu_us[c];
    m.cpu_us[c] = median(v, k);
  }
  return m;
}

static void print_run(int run, const result r[N_CONTENDERS]) {
  printf("  run %d:", run + 1);
  for (int c = 0; c < N_CONTENDERS; c++) {
    if (!r[c].ok) continue;
    printf("  %s p50 %.1f p99 %.1f us", c == FLOOR ? "tcp" : c == OURS ? "ours" : "grpc++",
           r[c].p50_us, r[c].p99_us);
    if (c != FLOOR)
      printf(" %.0f/%.0f/%.0f calls/s", r[c].tput[0], r[c].tput[1],
             r[c].tput[2]);
  }
  printf("\n");
}

static int report(const bench_opts *o, result runs[][N_CONTENDERS],
                  size_t req_len) {
  result m[N_CONTENDERS];
  result col[64];
  for (int c = 0; c < N_CONTENDERS; c++) {
    for (int i = 0; i < o->runs; i++) col[i] = runs[i][c];
    m[c] = med(col, o->runs);
  }
  const result *fl = &m[FLOOR], *us = &m[OURS], *gp = &m[GRPCPP];
  printf("\nmedian of %d run%s; latency: 1 caller; throughput: N calls in "
         "flight on one connection\n",
         o->runs, o->runs == 1 ? "" : "s");
  printf("%-27s %9s %9s %9s %9s %10s %10s %10s\n", "", "p50 us", "p99 us",
         "p50/floor", "p99/floor", "1 caller", "8 callers", "64 callers");
  for (int c = 0; c < N_CONTENDERS; c++) {
    const result *r = &m[c];
    if (!r->ok) {
      printf("%-27s %s\n", k_names[c],
             c == GRPCPP && o->grpcpp_server == NULL ? "skipped" : "failed");
      continue;
    }
    printf("%-27s %9.1f %9.1f %8.2fx %8.2fx %10.0f", k_names[c], r->p50_us,
           r->p99_us, r->p50_us / fl->p50_us, r->p99_us / fl->p99_us,
           r->tput[0]);
    if (c == FLOOR)
      printf(" %10s %10s\n", "-", "-");
    else
      printf(" %10.0f %10.0f\n", r->tput[1], r->tput[2]);
  }
  if (us->ok && gp->ok) {
    printf("%-27s %9s %9s %9s %9s", "ours / gRPC C++", "", "", "", "");
    for (int i = 0; i < N_CALLERS; i++)
      printf(" %9.2fx", us->tput[i] / gp->tput[i]);
    printf("\n%-27s %8.2fx %8.2fx\n", "gRPC C++ / ours latency",
           gp->p50_us / us->p50_us, gp->p99_us / us->p99_us);
  }
  printf("(request and reply: %zu-byte Echo message; floor message: the same "
         "%zu bytes)\n",
         req_len, req_len);
  printf("\nCPU per call, client + server (us; the client is ours in both "
         "rows)\n");
  printf("%-27s %10s %10s %10s\n", "", "1 caller", "8 callers", "64 callers");
  for (int c = OURS; c < N_CONTENDERS; c++) {
    if (!m[c].ok) continue;
    printf("%-27s", k_names[c]);
    for (int i = 0; i < N_CALLERS; i++)
      if (m[c].cpu_us[i] > 0)
        printf(" %10.2f", m[c].cpu_us[i]);
      else
        printf(" %10s", "?");
    printf("\n");
  }

  int fails = 0;
  printf("\ngoals\n");
  if (fl->ok && us->ok) {
    double x = us->p50_us / fl->p50_us;
    bool pass = x <= GOAL_P50_VS_FLOOR;
    fails += !pass;
    printf("  p50 latency <= %.1fx the raw TCP round trip: %.2fx (%.1f vs "
           "%.1f us)  %s\n",
           GOAL_P50_VS_FLOOR, x, us->p50_us, fl->p50_us,
           pass ? "PASS" : "FAIL");
  } else {
    printf("  p50 latency <= %.1fx the raw TCP round trip: not measured  "
           "FAIL\n",
           GOAL_P50_VS_FLOOR);
    fails++;
  }
  if (o->grpcpp_server == NULL) {
    const char *why = o->grpcpp_skip;
    while (*why == ' ') why++;
    printf("  throughput >= %.0fx gRPC C++ at 1/8/64 callers: SKIPPED (%s)\n",
           GOAL_TPUT_VS_GRPCPP, why);
  } else if (us->ok && gp->ok) {
    bool pass = true;
    printf("  throughput >= %.0fx gRPC C++ at 1/8/64 callers:",
           GOAL_TPUT_VS_GRPCPP);
    for (int i = 0; i < N_CALLERS; i++) {
      double x = us->tput[i] / gp->tput[i];
      pass = pass && x >= GOAL_TPUT_VS_GRPCPP;
      printf(" %.2fx%s", x, i + 1 < N_CALLERS ? " /" : "");
    }
    printf("  %s\n", pass ? "PASS" : "FAIL");
    fails += !pass;
  } else {
    printf("  throughput >= %.0fx gRPC C++ at 1/8/64 callers: not measured  "
           "FAIL\n",
           GOAL_TPUT_VS_GRPCPP);
    fails++;
  }
  return fails;
}

/* ------------------------------------------------------------------ */
/* main                                                                */
/* ------------------------------------------------------------------ */

static void usage(FILE *f) {
  fprintf(f,
          "usage: rpc [--seconds S] [--runs N] [--payload BYTES] "
          "[--grpcpp-threads N] [--no-grpcpp] [--help]\n"
          "  --seconds S         measuring time per figure, after a short "
          "warm-up (default 1)\n"
          "  --runs N            repeat every figure N times, interleaved, "
          "and show the median (default 3)\n"
          "  --payload BYTES     payload bytes in each Echo request (default "
          "90: a ~100-byte message)\n"
          "  --grpcpp-threads N  completion-queue threads of the gRPC C++ "
          "server (default: one per CPU)\n"
          "  --no-grpcpp         leave the gRPC C++ server out (e.g. to "
          "profile our engine alone)\n"
          "Unary Echo latency (p50/p99, 1 caller) and throughput (1, 8, 64 "
          "callers) of our gRPC\n"
          "engine, against a raw TCP ping-pong (the floor) and a gRPC C++ "
          "server, both measured\n"
          "in the same run; the same client (ours) drives both servers. "
          "Reports the ratios and\n"
          "PASS/FAIL for the goals: p50 <= %.1fx the TCP floor, throughput >= "
          "%.0fx gRPC C++.\n",
          GOAL_P50_VS_FLOOR, GOAL_TPUT_VS_GRPCPP);
}

static int parse_args(int argc, char **argv, bench_opts *o) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    char *end = NULL;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      exit(0);
    } else if (strcmp(a, "--seconds") == 0 && v) {
      o->seconds = strtod(v, &end);
      if (*end != '\0' || !(o->seconds >= 0.01 && o->seconds <= 3600))
        goto bad;
    } else if (strcmp(a, "--runs") == 0 && v) {
      o->runs = (int)strtol(v, &end, 10);
      if (*end != '\0' || o->runs < 1 || o->runs > 64) goto bad;
    } else if (strcmp(a, "--payload") == 0 && v) {
      unsigned long n = strtoul(v, &end, 10);
      if (*end != '\0' || n > (1u << 20)) goto bad;
      o->payload = n;
    } else if (strcmp(a, "--no-grpcpp") == 0) {
      o->grpcpp_server = NULL;
      o->grpcpp_skip = " --no-grpcpp given";
      continue;
    } else if (strcmp(a, "--grpcpp-threads") == 0 && v) {
      o->grpcpp_threads = (int)strtol(v, &end, 10);
      if (*end != '\0' || o->grpcpp_threads < 1 || o->grpcpp_threads > 256)
        goto bad;
    } else {
      usage(stderr);
      return SP_EINVAL;
    }
    i++;
    continue;
  bad:
    fprintf(stderr, "rpc: bad value for %s: %s\n", a, v);
    return SP_EINVAL;
  }
  return 0;
}

int main(int argc, char **argv) {
  bench_opts o = {.seconds = 1, .runs = 3, .payload = 90};
#ifdef SP_GRPCPP_SERVER
  o.grpcpp_server = SP_GRPCPP_SERVER;
#else
  o.grpcpp_skip = SP_GRPCPP_MISSING;
#endif
  if (parse_args(argc, argv, &o) != 0) return 2;
  signal(SIGPIPE, SIG_IGN);

  /* the request: a short text and the payload (the reply echoes both, so
   * its bytes equal the request's) */
  uint8_t *payload = malloc(o.payload ? o.payload : 1);
  for (size_t i = 0; i < o.payload; i++) payload[i] = (uint8_t)(i * 7 + 1);
  Shardplane__Testing__EchoRequest rq = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  rq.text = (char *)"bench";
  rq.payload.data = payload;
  rq.payload.len = o.payload;
  size_t req_len = shardplane__testing__echo_request__get_packed_size(&rq);
  uint8_t *req = malloc(req_len);
  shardplane__testing__echo_request__pack(&rq, req);

  printf("rpc: unary Echo.Unary on loopback, %ld CPUs online, %.2f s per "
         "figure, %d run%s\n",
         sysconf(_SC_NPROCESSORS_ONLN), o.seconds, o.runs,
         o.runs == 1 ? "" : "s");
  printf("  floor: blocking TCP ping-pong between two threads, TCP_NODELAY, "
         "%zu-byte messages\n",
         req_len);
  printf("  ours: sp_rpc Echo server on its own loop in a thread\n");
  if (o.grpcpp_server != NULL)
    printf("  gRPC C++: async server in a child process, %s\n",
           o.grpcpp_threads ? "--grpcpp-threads completion-queue threads"
                            : "one completion-queue thread per CPU");
  else
    printf("  gRPC C++ comparison skipped:%s\n", o.grpcpp_skip);
  printf("  client for both RPC servers: sp_rpc async client, one "
         "connection, one loop\n");
  fflush(stdout);

  sp_diag d = {""};
  tcp_floor tf;
  our_server os;
  grpcpp_server gs = {0};
  if (tcp_floor_start(&tf, req_len) != 0) {
    fprintf(stderr, "rpc: cannot start the TCP echo thread\n");
    return 1;
  }
  if (our_server_start(&os, &d) != 0) {
    fprintf(stderr, "rpc: our server: %s\n", d.msg);
    return 1;
  }
  if (o.grpcpp_server != NULL && grpcpp_start(&gs, &o, &d) != 0) {
    fprintf(stderr, "rpc: gRPC C++ server: %s\n", d.msg);
    o.grpcpp_skip = " its server did not start";
    o.grpcpp_server = NULL;
  }

  uv_loop_t loop;
  uv_loop_init(&loop);
  driver ours, theirs;
  if (driver_open(&ours, &loop, os.port, req, req_len) != 0 ||
      (o.grpcpp_server != NULL &&
       driver_open(&theirs, &loop, gs.port, req, req_len) != 0)) {
    fprintf(stderr, "rpc: cannot create the client\n");
    return 1;
  }
  if (o.grpcpp_server != NULL) theirs.server_pid = gs.pid;

  result runs[64][N_CONTENDERS];
  memset(runs, 0, sizeof runs);
  int rc = 0;
  for (int i = 0; i < o.runs; i++) {
    if (tcp_floor_measure(&tf, &o, &runs[i][FLOOR]) != 0) {
      fprintf(stderr, "rpc: the TCP ping-pong failed\n");
      rc = 1;
    }
    if (cl_measure(&ours, &o, &runs[i][OURS], "ours") != 0) rc = 1;
    if (o.grpcpp_server != NULL &&
        cl_measure(&theirs, &o, &runs[i][GRPCPP], "gRPC C++") != 0)
      rc = 1;
    print_run(i, runs[i]);
    fflush(stdout);
  }
  int fails = report(&o, runs, req_len);
  (void)fails; /* goals are reported, not an error of the benchmark */

  driver_close(&ours);
  if (o.grpcpp_server != NULL) driver_close(&theirs);
  uv_loop_close(&loop);
  if (o.grpcpp_server != NULL) grpcpp_stop(&gs);
  our_server_stop(&os);
  tcp_floor_stop(&tf);
  free(req);
  free(payload);
  return rc;
}
