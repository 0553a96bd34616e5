"""Fast forward passes for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3).

Hugging Face's modules serve every architecture and option, and each forward pays for that:
module dispatch, keyword plumbing, mask building, and under bf16 autocast a cast per matmul.
On a small model that overhead *is* the step (a 2-layer model spends far longer in it than
in arithmetic). This package runs the same arithmetic from the model's own parameters, in
plain torch operations, with the decoder layer written once (`layer`):

* `backbone(...)` / `lm_forward(...)` (`training`): a teacher-forced pass with autograd,
  with the contract of the HF forward that `labkit.model.scoring` uses.
* `Decoder` (`decoder`): the rollout's prefill and decode steps on packed weights, reading
  the KV cache through a strategy (`kv`): `FullCache` (the prompt's keys per row) or
  `SharedPrefix` (once per group).
* `kernels`: a decode step's work between its products (norms, RoPE with the attention,
  SwiGLU) as three C functions, built with the machine's compiler on first use, for small
  fp32 models on a CPU; torch operations where they cannot be built.
* `replay`: a rollout's per-layer outputs, kept by the decoder (`Decoder.record`), which the
  update's first teacher-forced pass takes instead of computing its products (the
  backward unchanged).
* `lm_forward_or`, `backbone_or`, `decoder_or`: choosers that give these paths for the models
  they cover and a plain path (the model's own forward) for the others.

Rotary embeddings come from the model's own `rotary_emb` module, so every RoPE variant it
implements (Llama 3 scaling, YaRN, ...) is followed. `unsupported(model)` names what rules a
model out (None when these paths apply); the HF forward is also the reference the equivalence
tests compare against (`tests/test_lean.py`).
"""

from labkit.fast.decoder import (CPU_LOW_PRECISION_MIN_PARAMS, SHARED_PREFIX_MIN_TOKENS, Decoder,
                                  decoder_or, rollout_dtype)
from labkit.fast.kv import FullCache, SharedPrefix
from labkit.fast.layer import attention_bias, compute_dtype, layer
from labkit.fast.support import FAMILIES, unsupported
from labkit.fast.training import (FastCache, Forward, backbone, backbone_or, lm_forward,
                                  lm_forward_or)

__all__ = ["CPU_LOW_PRECISION_MIN_PARAMS", "FAMILIES", "SHARED_PREFIX_MIN_TOKENS", "Decoder",
           "FastCache", "Forward", "FullCache", "SharedPrefix", "attention_bias", "backbone",
           "backbone_or", "compute_dtype", "decoder_or", "layer", "lm_forward", "lm_forward_or",
           "rollout_dtype", "unsupported"]
