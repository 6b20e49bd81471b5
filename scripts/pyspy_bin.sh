#!/usr/bin/env bash
# Print the path of a runnable py-spy binary, unpacked from the wheel carried in
# .gpu/extra/ (pip --target does not install a wheel's binary); prints nothing and exits
# 1 when no wheel is there. Used by scripts/h200_runs.sh and scripts/h200_ab.sh.
W=$(ls .gpu/extra/py_spy-*.whl 2>/dev/null | head -1)
[ -n "$W" ] || exit 1
python3 -m zipfile -e "$W" /tmp/pyspyw
P=$(find /tmp/pyspyw -name py-spy -type f | head -1)
[ -n "$P" ] || exit 1
chmod +x "$P" && echo "$P"
