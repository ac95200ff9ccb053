"""``python -m composer_dag.gateway``: see ``composer_dag.gateway.server``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m composer_dag.gateway",
                                description="the recording OpenAI-compatible gateway in front of rollout servers")
    p.add_argument("--model", required=True, help="the served checkpoint's directory (its tokenizer and chat template)")
    p.add_argument("--upstream", nargs="+", required=True, help="vLLM server URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--admin-port", type=int, default=8101)
    p.add_argument("--records", default=None, help="a directory: each key's calls appended as JSON lines")
    p.add_argument("--sessions", default=None, help="a directory: product sessions closed through the admin API "
                                                     "(POST /admin/keys/KEY/session) appended as composer-session/2 "
                                                     "JSON lines under <YYYY-MM-DDTHH>/, the production traces' intake")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--served-name", default=None, help="the model name clients use (default: the directory's name)")
    a = p.parse_args(argv)
    if not os.path.isdir(a.model):
        p.error(f"--model {a.model} is not a directory")
    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer, serve_forever
    from composer_dag.gateway.upstream import Servers
    from composer_dag.inference.engine import model_max_len
    from composer_dag.train.tokenizer import load_tokenizer

    gw = Gateway(Servers(a.upstream), load_tokenizer(a.model), a.served_name or os.path.basename(a.model.rstrip("/")),
                 a.max_model_len or model_max_len(a.model) or 2048, records_dir=a.records,
                 sessions_dir=a.sessions)
    given = os.environ.get("COMPOSER_GATEWAY_ADMIN_TOKEN")
    server = GatewayServer(gw, a.host, a.port, admin_port=a.admin_port, admin_token=given)
    if not given:  # a token made here: the runner of episodes needs it, and only this log shows it
        print(f"admin token (set COMPOSER_GATEWAY_ADMIN_TOKEN to choose one): {server.admin_token}", flush=True)
    serve_forever(server.start(), log=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
