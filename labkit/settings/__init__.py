"""What a run is asked to do: `TrainConfig` with every default and check, the rules between
fields, the one reader of a value given as text (`fields`), and `preflight`, which finds
what the config names on this machine before any model loads."""
