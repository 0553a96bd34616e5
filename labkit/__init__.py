"""labkit: an interactive lab for reinforcement learning of language models.

Building blocks (tasks, rewards, models, evaluation) that notebooks assemble into GRPO-vs-PPO
experiments. Import the modules you need: `from labkit import models, rewards, tasks`.
"""

__version__ = "0.1.0"
