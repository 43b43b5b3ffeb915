#!/usr/bin/env bash
# Run a command with the notebook settings from tests/notebook.env exported.
# Usage: tests/with_notebook_env.sh COMMAND [ARGS...]
set -euo pipefail
env_file="$(dirname "${BASH_SOURCE[0]}")/notebook.env"
while IFS= read -r line || [[ -n "$line" ]]; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  if [[ "$line" != *=* ]]; then
    echo "error: $env_file: '$line' is not a KEY=VALUE line" >&2
    exit 2
  fi
  export "${line%%=*}=${line#*=}"
done < "$env_file"
exec "$@"
