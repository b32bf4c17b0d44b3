/* Serves the Echo test service: prints "PORT <n>" once listening, shuts
 * down gracefully on SIGINT/SIGTERM. Used by the interop tests. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo_service.h"

static void on_shutdown_done(sp_rpc_server *srv, void *arg) {
  (void)srv;
  uv_signal_t *sigs = arg;
  uv_close((uv_handle_t *)&sigs[0], NULL);
  uv_close((uv_handle_t *)&sigs[1], NULL);
}

static void on_signal(uv_signal_t *s, int signum) {
  (void)signum;
  sp_rpc_server *srv = s->data;
  uv_signal_t *sigs = s->loop->data;
  sp_rpc_server_shutdown(srv, 2000, on_shutdown_done, sigs);
}

int main(int argc, char **argv) {
  const char *addr = "127.0.0.1:0";
  sp_rpc_server_opts opts = {0};
  sp_rpc_tls_server_opts tls = {0};
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc)
      addr = argv[++i];
    else if (strcmp(argv[i], "--max-message") == 0 && i + 1 < argc)
      opts.max_message = strtoul(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--tls-cert") == 0 && i + 1 < argc)
      tls.cert_file = argv[++i];
    else if (strcmp(argv[i], "--tls-key") == 0 && i + 1 < argc)
      tls.key_file = argv[++i];
    else if (strcmp(argv[i], "--tls-client-ca") == 0 && i + 1 < argc)
      tls.client_ca_file = argv[++i];
    else {
      fprintf(stderr,
              "usage: echo_server [--listen host:port] "
              "[--max-message bytes] [--tls-cert PEM --tls-key PEM "
              "[--tls-client-ca PEM]]\n");
      return 2;
    }
  }
  if (tls.cert_file != NULL || tls.key_file != NULL) opts.tls = &tls;
  signal(SIGPIPE, SIG_IGN);
  uv_loop_t *loop = uv_default_loop();
  sp_rpc_server *srv;
  sp_diag d = {""};
  int port;
  if (sp_rpc_server_new(loop, &opts, &srv) != 0 || sp_echo_register(srv) != 0 ||
      sp_rpc_server_listen(srv, addr, &port, &d) != 0) {
    fprintf(stderr, "echo_server: %s\n", d.msg[0] ? d.msg : "setup failed");
    return 1;
  }
  uv_signal_t sigs[2];
  loop->data = sigs;
  uv_signal_init(loop, &sigs[0]);
  uv_signal_init(loop, &sigs[1]);
  sigs[0].data = sigs[1].data = srv;
  uv_signal_start(&sigs[0], on_signal, SIGINT);
  uv_signal_start(&sigs[1], on_signal, SIGTERM);
  printf("PORT %d\n", port);
  fflush(stdout);
  uv_run(loop, UV_RUN_DEFAULT);
  sp_rpc_server_free(srv);
  uv_loop_close(loop);
  return 0;
}
