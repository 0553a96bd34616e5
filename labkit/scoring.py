"""Teacher-forced passes over a rollout: log-probs and entropy of the policy, values of a critic.

Shapes: B prompts, G per group, N = B*G rows, P prompt tokens (left-padded), T completion
tokens (right-padded), L = P + T, V vocabulary. Row n of a rollout is prompt n // G followed
by completion n; the logits that predict completion token t sit at position P - 1 + t, so
only the last T + 1 positions are ever turned into logits (`logits_to_keep`), never the
prompt's.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from labkit.losses import entropy as entropy_of
from labkit.rollout import RolloutBatch


def sequences(batch: RolloutBatch, rows: Tensor | None = None):
    """`(input_ids, attention_mask, position_ids)`, each (n, L), for the given rows (all if None)."""
    rows = torch.arange(batch.completion_ids.shape[0], device=batch.completion_ids.device) \
        if rows is None else rows
    prompt = batch.group_index[rows]
    ids = torch.cat([batch.prompt_ids[prompt], batch.completion_ids[rows]], dim=1)  # (n, L)
    mask = torch.cat([batch.prompt_mask[prompt], batch.completion_mask[rows]], dim=1)  # (n, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def token_logprobs(model, batch: RolloutBatch, rows: Tensor | None = None, *,
                   temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs (n, T) of the completion tokens under `model`, and their entropy (n, T).

    Logits are divided by `temperature`, as when the rollout sampled, so a policy equal to
    the sampling one gives ratio 1. Log-probs are fp32 whatever the model's dtype. The
    entropy is detached unless `entropy_grad` (an entropy bonus needs its gradient).
    """
    ids, mask, positions = sequences(batch, rows)
    T = batch.completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                logits_to_keep=T + 1)
    logits = out.logits[:, :-1].float() / temperature  # (n, T, V)
    targets = ids[:, -T:]
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)  # (n, T)
    ent = None
    if with_entropy:
        ent = entropy_of(logits if entropy_grad else logits.detach())
    return logp, ent


class ValueModel(nn.Module):
    """PPO's critic: a copy of the policy's backbone and a linear head, one value per token.

    Initialised from the policy (same backbone weights) with a zero head, so every value
    starts at 0. It is a separate network with its own optimizer: the policy never shares
    its weights or its gradients.
    """

    def __init__(self, policy):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.head.to(next(self.backbone.parameters()).device)

    def forward(self, input_ids, attention_mask, position_ids) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()  # (n, L)


def token_values(critic: ValueModel, batch: RolloutBatch, rows: Tensor | None = None) -> Tensor:
    """Values (n, T): V at the state before each completion token (position P - 1 + t)."""
    ids, mask, positions = sequences(batch, rows)
    T = batch.completion_ids.shape[1]
    return critic(ids, mask, positions)[:, -T - 1:-1]
