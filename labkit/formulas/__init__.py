"""The formulas, pure functions on tensors: advantages and every estimator under one
signature, loss aggregation and the clipped surrogate, the policy-loss modes, the
sampler-learner mismatch, the step's metrics and their table, and the statistics that turn
seeds into intervals and verdicts."""
