/* Shared pieces of the `shardplane` command. */
#ifndef SP_CLI_H
#define SP_CLI_H

#include <stdio.h>

/* Exit codes: scripts tell these apart. */
enum {
  SP_EXIT_OK = 0,
  SP_EXIT_FAILURE = 1,     /* the operation failed (bad spec, I/O, ...) */
  SP_EXIT_USAGE = 2,       /* bad command line */
  SP_EXIT_NOT_FOUND = 3,   /* the FQN, rank or unit asked for does not exist */
  SP_EXIT_UNREACHABLE = 4, /* no coordinator answered */
};

/* `shardplane plan ...`; argv[0] is "plan". */
int sp_cmd_plan(int argc, char **argv);

/* Prints "shardplane <cmd>: <message>" to stderr. */
void sp_cli_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
