"""Helpers several stages share: how images are read (data), the training loop (loop,
training_run) and the generator-fidelity judges (fidelity). Not a stage."""
