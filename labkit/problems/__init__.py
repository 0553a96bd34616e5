"""Problems and rewards: the tasks with their ground truth (arithmetic, think, GSM8K, any local
dataset file, code), where a step's problems come from (`source`), answer extraction, the
rewards and the config's reward expression."""
