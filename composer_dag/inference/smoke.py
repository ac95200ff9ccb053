"""Load a checkpoint in an inference engine and sample a short continuation::

    python -m composer_dag.inference.smoke CHECKPOINT_DIR [--engine vllm|hf] [--prompt TEXT]

The JSON summary (engine, new token count, text) is the last line of standard output.
"""

from __future__ import annotations

import argparse
import json


def smoke(checkpoint_dir: str, engine: str = "vllm", prompt: str = "def fibonacci(n):\n", max_tokens: int = 32) -> dict:
    from ..train.tokenizer import load_tokenizer
    from . import Sampling, make_engine

    tok = load_tokenizer(checkpoint_dir)
    kw = {"max_model_len": 512, "kv_cache_bytes": 64 << 20} if engine == "vllm" else {}
    eng = make_engine(engine, checkpoint_dir, **kw)
    try:
        out = eng.generate([tok(prompt)["input_ids"]], Sampling(n=1, temperature=0.8, max_tokens=max_tokens, seed=0))[0]
    finally:
        eng.close()
    return {"engine": engine, "new_tokens": len(out.token_ids), "text": prompt + tok.decode(out.token_ids, skip_special_tokens=True)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--prompt", default="def fibonacci(n):\n")
    args = p.parse_args(argv)
    result = smoke(args.checkpoint_dir, args.engine, args.prompt)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
