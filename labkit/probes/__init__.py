"""What looks at a policy without training it: held-out evaluation, the estimator
diagnostics, the credit microscope, the sample of rollouts kept token by token, and the
periodic looks a run takes into logs of their own."""
