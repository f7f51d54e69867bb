"""A client that ignores proxy variables, run by the transparent e2e test inside bili's namespace
(``bili run --transparent -- python transparent_client.py ARGS.json``).

It runs the scripted fold session of test_fold_e2e on the chat lane with the official ``openai`` SDK
over an httpx client built with ``trust_env=False`` (HTTPS_PROXY is set in its environment and
ignored), trusting the CA named by ``SSL_CERT_FILE`` as bili's launcher sets it; then it fetches a
page from a non-model TLS server trusting only that server's own CA.  It prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

import openai  # noqa: E402

from e2e.support import ChatAgent, httpx2  # noqa: E402


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out: dict = {"https_proxy": os.environ.get("HTTPS_PROXY"), "answers": {}}
    bili_ca = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])

    class Client(ChatAgent):
        def connect(self) -> None:
            hc = httpx2.Client(transport=httpx2.HTTPTransport(trust_env=False, verify=bili_ca), timeout=20,
                               trust_env=False)
            self.client = openai.OpenAI(api_key="sk-fake", base_url=cfg["model_url"], http_client=hc, max_retries=0)

    def run_bash(call, turn: int) -> str:
        return "\n".join(f"file-{turn}-row-{i}: value={(turn * 7919 + i * 104729) % 1000003:07d} ok" for i in range(50))

    agent = Client(cfg["model_url"], cfg["sid"], cfg["sid"], cfg["task"], stream=True)
    for turn in range(1, cfg["turns"] + 1):
        out["answers"][turn] = agent.step(turn, run_bash).text

    other_ca = ssl.create_default_context(cafile=cfg["other_ca"])
    with httpx2.Client(trust_env=False, verify=other_ca, timeout=10) as c:
        r = c.get(cfg["other_url"])
        out["other"] = {"status": r.status_code, "body": r.text}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
