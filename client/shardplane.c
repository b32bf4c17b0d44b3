/* shardplane: the operator's command. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"

#define SP_VERSION "0.1.0"

static const struct {
  const char *name;
  int (*fn)(int, char **);
  const char *summary;
} k_commands[] = {
    {"plan", sp_cmd_plan,
     "print the sharding plan of a model spec (offline, --model)"},
};

void sp_cli_error(const char *cmd, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "shardplane %s: ", cmd);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: shardplane <command> [options]   (shardplane <command> "
          "--help for its options)\n\ncommands:\n");
  for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
    fprintf(f, "  %-10s %s\n", k_commands[i].name, k_commands[i].summary);
  fprintf(f,
          "\nexit codes: 0 ok, 1 failure, 2 bad usage, 3 not found, "
          "4 coordinator unreachable\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return SP_EXIT_USAGE;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 ||
      strcmp(cmd, "help") == 0) {
    usage(stdout);
    return SP_EXIT_OK;
  }
  if (strcmp(cmd, "--version") == 0) {
    printf("shardplane %s\n", SP_VERSION);
    return SP_EXIT_OK;
  }
  for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
    if (strcmp(cmd, k_commands[i].name) == 0)
      return k_commands[i].fn(argc - 1, argv + 1);
  fprintf(stderr, "shardplane: unknown command \"%s\"\n", cmd);
  usage(stderr);
  return SP_EXIT_USAGE;
}
