"""Generation: the batch generator (prompts x seeds -> images), locally or on Ray."""
