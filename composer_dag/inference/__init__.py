"""Rollout inference behind one narrow interface: token ids in, sampled token ids and their
sampling logprobs out, new weights in by directory.

    engine = make_engine("vllm", model_dir)
    outs = engine.generate([[1, 2, 3]], Sampling(n=4, temperature=1.0, max_tokens=64))
    engine.load_weights(new_dir)   # a directory holding model.safetensors
    engine.close()
"""

from .engine import (Completion, Engine, HFEngine, InferenceConfig, Sampling, VLLMEngine, engine_from_config,
                     fit_to_model, make_engine)

__all__ = ["Completion", "Engine", "HFEngine", "InferenceConfig", "Sampling", "VLLMEngine", "engine_from_config",
           "fit_to_model", "make_engine"]
