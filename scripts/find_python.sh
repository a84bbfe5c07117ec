#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter (the GPU image's version): $PYTHON, then PATH, then pyenv.
set -euo pipefail
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
for cand in "${PYTHON:-}" python3.12 python3; do
  [ -n "$cand" ] || continue
  path=$(command -v "$cand" 2>/dev/null) || continue
  if ok "$path"; then echo "$path"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1 || [ -x "${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv" ]; then
  pyenv_bin=$(command -v pyenv || echo "${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv")
  root=$("$pyenv_bin" root)
  for v in $("$pyenv_bin" versions --bare | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
    if ok "$root/versions/$v/bin/python"; then echo "$root/versions/$v/bin/python"; exit 0; fi
  done
fi
echo "find_python.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
exit 1
