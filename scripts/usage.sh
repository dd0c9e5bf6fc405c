# Sourced by every script of the project, so that each answers `--help` the same way: the
# script's header comment (the lines starting with `#` after the shebang) is its usage,
# printed as it stands, and the script then exits 0 having done nothing else. An argument
# a script does not know is an error (exit 2), never a run.

# Prints the calling script's header comment.
usage() {
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# For a script that takes no arguments: `--help` (or `-h`) prints its usage and exits 0;
# anything else is refused.
no_arguments() {
  case "${1:-}" in
    "") return 0 ;;
    -h | --help) usage; exit 0 ;;
    *) unknown_argument "$1" ;;
  esac
}

# Refuses an argument, naming it and where the usage is.
unknown_argument() {
  echo "$0: unknown argument '$1' (see $0 --help)" >&2
  exit 2
}
