"""``tnlg serve`` in a process of its own for the tests (:class:`Server`): started with ``--port 0``, its address
read from the line rank 0 prints, stopped by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """``tnlg serve`` in a process of its own, until :meth:`stop`."""

    def __init__(self, folder, *extra: str, timeout: float = 180.0):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "tnlg", "serve", "--checkpoint", str(folder),
                                      "--tokenizer-model", "builtin", "--port", "0", "--served-model-name", "served",
                                      *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if " on http://" in line:
                self.url = line.split(" on ")[1].split(" ")[0]
                break
        if self.url is None:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {self.lines} {self.proc.stderr.read()}")

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, err
