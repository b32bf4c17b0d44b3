/* `shardplane token create`: a fresh bearer token for a coordinator's
 * token file (auth/token.h). The token goes to stdout, once; the
 * file gets only its hash. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "auth/token.h"
#include "base/flag.h"
#include "cli.h"

#define TOKEN "token"

static void usage(FILE *f) {
  fputs(
      "usage: shardplane token create --role ROLE --token-file FILE "
      "[--name NAME]\n"
      "\n"
      "Makes a bearer token (256 random bits, shown as spt_...), prints it\n"
      "on stdout and appends its SHA-256 hash, role and name to FILE, the\n"
      "coordinator's --token-file (created with mode 0600; a file others\n"
      "may read or write is refused). The token itself is stored nowhere:\n"
      "keep what is printed, e.g. in a file of mode 0600 for --token-file\n"
      "of shardplane-worker and the shardplane commands, or in\n"
      "$SHARDPLANE_TOKEN. A coordinator reads its token file when it\n"
      "starts.\n"
      "\n"
      "  --role ROLE                worker (attach ranks, report, the\n"
      "                             store keys under comm/), reader\n"
      "                             (queries, Watch, store reads) or\n"
      "                             admin (everything)\n"
      "  --token-file FILE          the coordinator's token file\n"
      "  --name NAME                shown in logs and errors (default\n"
      "                             ROLE-<8 random characters>); 1-64 of\n"
      "                             A-Z a-z 0-9 . _ -\n"
      "  --help                     this text\n"
      "\n"
      "exit codes: 0 done, 1 failure, 2 bad usage\n",
      f);
}

enum { OPT_ROLE = 1, OPT_FILE, OPT_NAME, OPT_HELP };

int sp_cmd_token(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "create") != 0) {
    if (argc >= 2 && strcmp(argv[1], "--help") == 0) {
      usage(stdout);
      return SP_EXIT_OK;
    }
    if (argc < 2)
      sp_cli_error(TOKEN, "missing subcommand (create)");
    else
      sp_cli_error(TOKEN, "unknown subcommand \"%s\" (expected create)",
                   argv[1]);
    sp_cli_try_help(TOKEN);
    return SP_EXIT_USAGE;
  }
  static const struct option opts[] = {
      {"role", required_argument, NULL, OPT_ROLE},
      {"token-file", required_argument, NULL, OPT_FILE},
      {"name", required_argument, NULL, OPT_NAME},
      {"help", no_argument, NULL, OPT_HELP},
      {NULL, 0, NULL, 0}};
  const char *file = NULL, *name = NULL;
  int role = 0, c;
  sp_diag d = {{0}};
  optind = 1;
  argv++;
  argc--;
  /* getopt names argv[0] in its messages: "shardplane token", not
   * "create" */
  char prog[] = "shardplane " TOKEN, *argv0 = argv[0];
  argv[0] = prog;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case OPT_ROLE: {
        static const char *const roles[] = {"worker", "reader", "admin"};
        size_t i;
        if (sp_flag_choice("--role", optarg, roles, 3, &i, &d) != 0) {
          sp_cli_error(TOKEN, "%s", d.msg);
          return SP_EXIT_USAGE;
        }
        role = sp_auth_role_parse(roles[i]);
        break;
      }
      case OPT_FILE:
        file = optarg;
        if (sp_flag_text("--token-file", optarg, "a file", &d) != 0) {
          sp_cli_error(TOKEN, "%s", d.msg);
          return SP_EXIT_USAGE;
        }
        break;
      case OPT_NAME: name = optarg; break;
      case OPT_HELP: usage(stdout); return SP_EXIT_OK;
      default: sp_cli_try_help(TOKEN); return SP_EXIT_USAGE;
    }
  }
  argv[0] = argv0;
  if (optind < argc || role == 0 || file == NULL) {
    if (optind < argc)
      sp_cli_error(TOKEN, "unexpected argument \"%s\"", argv[optind]);
    else
      sp_cli_error(TOKEN, "%s is required",
                   role == 0 ? "--role" : "--token-file");
    sp_cli_try_help(TOKEN);
    return SP_EXIT_USAGE;
  }
  char token[SP_AUTH_TOKEN_LEN + 1], def_name[SP_AUTH_NAME_MAX + 1];
  if (sp_auth_token_new(token, &d) != 0) {
    sp_cli_error(TOKEN, "%s", d.msg);
    return SP_EXIT_FAILURE;
  }
  if (name == NULL) {
    /* from the token's random part, which the hash does not reveal */
    char r[SP_AUTH_TOKEN_LEN + 1];
    if (sp_auth_token_new(r, &d) != 0) {
      sp_cli_error(TOKEN, "%s", d.msg);
      return SP_EXIT_FAILURE;
    }
    snprintf(def_name, sizeof def_name, "%s-%.8s", sp_auth_role_name(role),
             r + 4);
    for (char *p = def_name; *p; p++)
      if (*p == '_') *p = '.';
    name = def_name;
  }
  int rc = sp_auth_file_add(file, token, role, name, &d);
  if (rc != 0) {
    sp_cli_error(TOKEN, "%s", d.msg);
    return rc == SP_EINVAL ? SP_EXIT_USAGE : SP_EXIT_FAILURE;
  }
  printf("%s\n", token);
  fprintf(stderr, "shardplane token: %s token \"%s\" added to %s\n",
          sp_auth_role_name(role), name, file);
  memset(token, 0, sizeof token);
  return fflush(stdout) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
}
