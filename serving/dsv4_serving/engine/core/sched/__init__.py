"""The scheduler: what runs in each step, and in which order prompts are admitted."""
