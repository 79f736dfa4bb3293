#!/usr/bin/env bash
# mypy over the `disagg` namespace by the names the code imports. setuptools
# maps the top-level folders to disagg.<part> with an import hook that mypy
# cannot follow (every disagg.* import would be read as Any), so a tree of
# links under build/ gives mypy the same names.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
view=build/typecheck
rm -rf "$view"
mkdir -p "$view/disagg"
for part in workers operator proto testing; do
  ln -s "../../../$part" "$view/disagg/$part"
done
export MYPYPATH=$view
"$python" -m mypy -p disagg.workers -p disagg.operator -p disagg.proto -p disagg.testing
"$python" -m mypy benchmarks
