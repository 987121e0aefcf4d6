"""Demo models and adapters: SmolLM2 with trained adapters (`smollm`, `run`), and a random model (`random_model`)."""
