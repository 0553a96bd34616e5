"""The model: loading (the embedded models, a local folder, a hub id), group sampling,
teacher-forced scoring, the learner's state (policy, reference, critic, optimizers), LoRA,
several processes, and what makes a run repeat bit for bit."""
